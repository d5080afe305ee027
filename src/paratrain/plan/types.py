"""The planner's inputs and outputs: the cluster, the model, one prediction.

Plain validated dataclasses (sizes in bytes, times in seconds, bandwidths in bytes/s),
shared by the communication model (:mod:`paratrain.plan.comm`), the memory model
(:mod:`paratrain.plan.memory`) and the strategies' cost models (:mod:`paratrain.plan.costs`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


def check_positive_int(name: str, value: Any) -> None:
    # bool is an int subclass; True would silently mean 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_number(name: str, value: Any, *, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        kind = "a positive" if positive else "a non-negative"
        raise ValueError(f"{name} must be {kind} finite number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The cluster: bandwidths in bytes/s, latencies in seconds, memory in bytes."""

    intra_node_bandwidth: float = 1.25e9  # 10 Gbit/s
    inter_node_bandwidth: float = 1.25e9
    intra_node_latency: float = 50e-6
    inter_node_latency: float = 50e-6
    device_memory_bytes: int | None = None  # None: memory is reported but not checked
    num_devices_per_node: int = 1
    num_nodes: int = 1

    def __post_init__(self) -> None:
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            check_number(name, getattr(self, name), positive=True)
        for name in ("intra_node_latency", "inter_node_latency"):
            check_number(name, getattr(self, name), positive=False)
        if self.device_memory_bytes is not None:
            check_number("device_memory_bytes", self.device_memory_bytes, positive=True)
        check_positive_int("num_devices_per_node", self.num_devices_per_node)
        check_positive_int("num_nodes", self.num_nodes)

    @property
    def world_size(self) -> int:
        """Total number of devices."""
        return self.num_devices_per_node * self.num_nodes


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """What the planner needs to know about one model (sizes in bytes, times in seconds)."""

    num_parameters: int
    param_bytes: float = 4
    grad_bytes: float = 4
    optimizer_bytes_per_param: float = 8  # Adam: two fp32 moments
    activation_bytes_per_sample: float
    compute_time_per_sample: float  # forward + backward on one device
    backward_fraction: float = 2 / 3
    num_layers: int = 1
    activation_checkpointing: bool = False
    chain: tuple[tuple[int, float], ...] = ()
    """For an ``nn.Sequential``: per child, ``(parameters, output bytes per sample)``.
    The pipeline is cut between children, so this gives what crosses each cut; empty:
    a boundary is estimated as ``activation_bytes_per_sample / num_layers``."""
    chain_times: tuple[float, ...] = ()
    """Per child of ``chain``: forward + backward seconds per sample, each child timed
    alone. Only the shares matter: a pipeline stage's time is its children's share of
    ``compute_time_per_sample``. Empty: stages are assumed equal."""
    optimizer_step_time: float = 0.0
    """Seconds of one optimizer step over all parameters on one device (once per step,
    not per sample). Strategies that shard the optimizer state divide it."""
    tp_allreduces: int = 0
    """All-reduces one forward + backward makes under the tensor-parallel plan (one per
    rowwise layer forward, one per colwise layer backward; see
    :mod:`paratrain.plan.tensor`). 0: unknown, and ``tp``/``fsdp_tp`` fall back to 4 per
    layer of ``activation_bytes_per_sample / num_layers`` each (an overestimate)."""
    tp_allreduce_bytes_per_sample: float = 0.0
    """Bytes per sample of those all-reduces, summed."""
    tp_split_fraction: float = 1.0
    """Share of ``compute_time_per_sample`` in the split layers' modules; the rest
    (embeddings, norms, head, loss) runs whole on every tensor rank. 1.0: all split."""
    tp_split_param_fraction: float = 1.0
    """Share of the parameters in split layers; the rest is replicated on every tensor rank."""
    tp_dispatch_time: float = 0.0
    """Seconds per step (not per sample) a tensor rank spends beyond its share of the
    arithmetic: DTensor's per-operation work on the host, large on CPU at small sizes.
    ``calibrate`` cannot measure it (it needs a process group); a split model timed on a
    fake process group can (``benchmarks/plan_validation_tp.py``). 0: not counted."""

    def __post_init__(self) -> None:
        check_positive_int("num_parameters", self.num_parameters)
        for name in ("param_bytes", "grad_bytes", "compute_time_per_sample"):
            check_number(name, getattr(self, name), positive=True)
        for name in ("optimizer_bytes_per_param", "activation_bytes_per_sample",
                     "optimizer_step_time"):
            check_number(name, getattr(self, name), positive=False)
        check_number("backward_fraction", self.backward_fraction, positive=False)
        if self.backward_fraction > 1:
            raise ValueError(f"backward_fraction must be in [0, 1], got {self.backward_fraction!r}")
        check_positive_int("num_layers", self.num_layers)
        for link in self.chain:
            if (len(link) != 2 or not isinstance(link[0], int) or isinstance(link[0], bool)
                    or link[0] < 0):
                raise ValueError(f"chain entries must be (parameters >= 0, output bytes), got {link!r}")
            check_number("chain output bytes", link[1], positive=False)
        if self.chain_times and len(self.chain_times) != len(self.chain):
            raise ValueError(f"chain_times must have one entry per chain entry "
                             f"({len(self.chain)}), got {len(self.chain_times)}")
        for seconds in self.chain_times:
            check_number("chain_times", seconds, positive=False)
        if isinstance(self.tp_allreduces, bool) or not isinstance(self.tp_allreduces, int) \
                or self.tp_allreduces < 0:
            raise ValueError(f"tp_allreduces must be an integer >= 0, got {self.tp_allreduces!r}")
        for name in ("tp_allreduce_bytes_per_sample", "tp_dispatch_time"):
            check_number(name, getattr(self, name), positive=False)
        for name in ("tp_split_fraction", "tp_split_param_fraction"):
            check_number(name, getattr(self, name), positive=False)
            if getattr(self, name) > 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(
                f"activation_checkpointing must be a bool, got {self.activation_checkpointing!r}"
            )

    @property
    def param_size(self) -> float:
        """Bytes of all parameters."""
        return self.num_parameters * self.param_bytes

    @property
    def grad_size(self) -> float:
        """Bytes of all gradients."""
        return self.num_parameters * self.grad_bytes

    @property
    def optimizer_size(self) -> float:
        """Bytes of the optimizer state."""
        return self.num_parameters * self.optimizer_bytes_per_param

    @property
    def stored_activation_bytes_per_sample(self) -> float:
        """Activation bytes kept for backward, per sample.

        With checkpointing only layer-boundary inputs stay alive plus one layer's
        recomputed activations during its backward: about 2 / num_layers of the total.
        """
        if not self.activation_checkpointing:
            return self.activation_bytes_per_sample
        return min(1.0, 2 / self.num_layers) * self.activation_bytes_per_sample

    @property
    def forward_time_per_sample(self) -> float:
        """Seconds of forward per sample."""
        return self.compute_time_per_sample * (1 - self.backward_fraction)

    @property
    def backward_time_per_sample(self) -> float:
        """Seconds of backward per sample; checkpointing re-runs the forward inside it."""
        extra = self.forward_time_per_sample if self.activation_checkpointing else 0.0
        return self.compute_time_per_sample * self.backward_fraction + extra

    @property
    def step_compute_time_per_sample(self) -> float:
        """Forward + backward (+ recomputation) per sample."""
        return self.forward_time_per_sample + self.backward_time_per_sample


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted cost of one strategy for one step (times in s, memory in bytes per device)."""

    strategy: str
    num_devices: int
    global_batch_size: int
    step_time: float
    compute_time: float
    comm_time: float  # all communication, as if nothing overlapped
    exposed_comm_time: float  # the part that adds to step_time
    bubble_time: float
    bubble_fraction: float
    traffic_bytes: float  # per step: bytes a device sends (ps: bytes a server moves)
    samples_per_second: float
    scaling_efficiency: float
    param_memory: float
    grad_memory: float
    optimizer_memory: float
    activation_memory: float
    memory_bytes: float
    fits: bool | None  # None when the device memory is unknown
    applicable: bool = True
    note: str = ""
    modelled: bool = True  # False: no cost model (the note says why); the numbers are 0
    optimizer_time: float = 0.0  # this device's share of the optimizer step
    layout: dict[str, int] | None = None  # hybrid: the degrees costed, outermost first
