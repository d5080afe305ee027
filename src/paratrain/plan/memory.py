"""Per-device memory of each strategy: model state (sharded or not) plus activations.

Parameters ``P``, gradients ``G`` and optimizer state ``O`` are divided by how many
devices share them; activations are ``b`` samples of what the profile keeps for
backward (less with activation checkpointing). Formulas in ``docs/plan.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.plan.types import ModelProfile

#: Which of (parameters, gradients, optimizer state) each strategy shards over its devices:
#: "N" divides by the number of devices, "1" keeps a full copy, "0" holds none.
SHARDING: dict[str, tuple[str, str, str]] = {
    "single": ("1", "1", "1"),
    "ddp": ("1", "1", "1"),
    "dp": ("1", "1", "1"),  # device 0 holds the master copy and the optimizer
    "zero1": ("1", "1", "N"),
    "zero2": ("1", "N", "N"),
    "fsdp": ("N", "N", "N"),
    "pipeline": ("N", "N", "N"),  # each stage holds 1/p of the layers
    "ps": ("1", "1", "0"),  # the servers hold the optimizer state
}


@dataclass(frozen=True, kw_only=True)
class MemoryEstimate:
    """Bytes one device holds during a step."""

    param_memory: float
    grad_memory: float
    optimizer_memory: float
    activation_memory: float

    @property
    def total(self) -> float:
        """Everything above, summed."""
        return self.param_memory + self.grad_memory + self.optimizer_memory + self.activation_memory


def state_divisors(strategy: str, num_devices: int) -> tuple[int, int, int]:
    """Divisors of (parameters, gradients, optimizer state); 0 means the device holds none."""
    if strategy not in SHARDING:
        raise ValueError(f"strategy: no memory model for {strategy!r} (known: {', '.join(SHARDING)})")
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < 1:
        raise ValueError(f"num_devices must be a positive integer, got {num_devices!r}")
    return tuple({"1": 1, "N": num_devices, "0": 0}[s] for s in SHARDING[strategy])  # type: ignore[return-value]


def memory_per_device(strategy: str, profile: ModelProfile, *, num_devices: int,
                      batch_size_per_device: int) -> MemoryEstimate:
    """Memory of one device running ``strategy`` on ``num_devices`` with ``b`` samples each.

    Example: 1M fp32 parameters with Adam under ``fsdp`` on 4 devices hold
    (4 MB + 4 MB + 8 MB) / 4 = 4 MB of state, plus activations.
    """
    sizes = (profile.param_size, profile.grad_size, profile.optimizer_size)
    divisors = state_divisors(strategy, num_devices)
    pm, gm, om = (0.0 if d == 0 else size / d for size, d in zip(sizes, divisors, strict=True))
    am = batch_size_per_device * profile.stored_activation_bytes_per_sample
    return MemoryEstimate(param_memory=pm, grad_memory=gm, optimizer_memory=om,
                          activation_memory=am)
