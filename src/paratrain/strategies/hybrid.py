"""``hybrid``: 2-D and 3-D layouts on one :class:`~paratrain.distributed.mesh.ParallelMesh`.

The degrees choose the layout (outermost axis first, see the mesh):

* pipeline x data parallel (``pipeline_degree > 1``): ``replicate_degree`` x
  ``shard_degree`` copies of a ``pipeline_degree``-stage pipeline. With
  ``shard_degree > 1`` each stage is sharded with FSDP2 (pipeline x FSDP), with
  ``tensor_degree > 1`` each stage's layers are also split by tensor parallel
  (pipeline x FSDP x TP, torchtitan's 3-D layout). 8 ranks = 2 PP x 2 FSDP x 2 TP.
* HSDP (``pipeline_degree == 1``): parameters sharded over ``shard_degree``
  ranks (by default the processes of one node) and replicated across nodes, so
  the all-gathers stay inside a node and only gradient all-reduces cross nodes.

The degrees are validated once, against the world size, with an error that
names the bad degree. The work is done by :class:`PipelineStrategy` or
:class:`FSDPStrategy` on the mesh; this class only builds the layout and
delegates every other member of the contract to that strategy (see
:func:`~paratrain.strategies.compose.delegate`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from paratrain.distributed.mesh import ParallelDegrees
from paratrain.distributed.topology import Topology
from paratrain.strategies.base import Strategy
from paratrain.strategies.capabilities import (
    Compiles,
    LockstepEvaluation,
    PrecisionPolicy,
    ShardedState,
    evaluation_batches,
)
from paratrain.strategies.compose import delegate
from paratrain.strategies.fsdp import FSDPOptions, FSDPStrategy
from paratrain.strategies.pipeline.strategy import PipelineOptions, PipelineStrategy
from paratrain.strategies.tensor.strategy import TPOptions


@dataclass(frozen=True, kw_only=True)
class HybridOptions:
    """Options of the ``hybrid`` strategy. Degrees left as None are inferred."""

    pipeline_degree: int = 1
    """Pipeline stages; > 1 selects a pipeline (x data parallel, x FSDP, x TP)."""

    shard_degree: int | None = None
    """FSDP shard size; default: the processes per node without a pipeline (HSDP),
    1 with one."""

    tensor_degree: int = 1
    """Tensor-parallel ranks per stage (needs ``pipeline_degree > 1``; without a pipeline
    use strategy ``fsdp_tp``)."""

    replicate_degree: int | None = None
    """Replicas; default: world size / (pipeline_degree x shard_degree)."""

    pipeline: dict[str, Any] = field(default_factory=dict)
    """Options of the pipeline (see ``PipelineOptions``), e.g. ``{"schedule": "gpipe"}``."""

    fsdp: dict[str, Any] = field(default_factory=dict)
    """Options of the sharding (see ``FSDPOptions``), e.g. ``{"reshard_after_forward": False}``."""

    tensor: dict[str, Any] = field(default_factory=dict)
    """Options of tensor parallel (see ``TPOptions``), e.g. ``{"plan": {...}}``."""

    def __post_init__(self) -> None:
        # Each field's own message first (type and range).
        ParallelDegrees(pipeline_degree=self.pipeline_degree, tensor_degree=self.tensor_degree)
        if self.pipeline and self.pipeline_degree == 1:
            raise ValueError("pipeline options need pipeline_degree > 1")
        if self.tensor_degree > 1 and self.pipeline_degree == 1:
            raise ValueError(f"tensor_degree={self.tensor_degree} without a pipeline: use "
                             "strategy 'fsdp_tp', or set pipeline_degree > 1")
        if self.tensor and self.tensor_degree == 1:
            raise ValueError("tensor options need tensor_degree > 1")
        if self.fsdp and self.pipeline_degree > 1 and self.shard_degree in (None, 1):
            raise ValueError("fsdp options inside a pipeline need shard_degree > 1")

    def degrees(self, topology: Topology) -> ParallelDegrees:
        """The validated layout for ``topology``."""
        shard = self.shard_degree
        if shard is None:
            shard = 1 if self.pipeline_degree > 1 else topology.local_world_size
        return ParallelDegrees.infer(world_size=topology.world_size,
                                     pipeline_degree=self.pipeline_degree,
                                     shard_degree=shard, replicate_degree=self.replicate_degree,
                                     tensor_degree=self.tensor_degree)


DELEGATED = (
    # core
    "data_parallel_rank", "data_parallel_size", "data_parallel_group", "random_stream_rank",
    "setup_model", "setup_optimizer", "unwrap", "backward", "optimizer_step", "no_sync",
    "clip_grad_norm", "model_state_dict", "load_model_state_dict", "optimizer_state_dict",
    "load_optimizer_state_dict", "all_reduce", "all_gather", "agree_flags", "barrier",
    "gather_rng_states", "teardown",
    # ShardedState
    "checkpoint_module", "partial_model", "save_sharded_state", "start_sharded_save",
    "load_sharded_state", "full_state_dict",
    # PrecisionPolicy
    "configure_precision",
    # Compiles
    "configure_compile", "cuda_graphs_blocker",
)


# Both inner strategies shard state and have a precision policy; whether evaluation
# runs in lockstep depends on the layout, so hybrid's evaluation_batches asks its inner
# strategy.
@delegate("inner", DELEGATED)
class HybridStrategy(Strategy, ShardedState, PrecisionPolicy, LockstepEvaluation, Compiles):
    """Pipeline x data parallel (x FSDP, x TP), or sharded within a node x replicated
    across nodes."""

    name = "hybrid"
    Options = HybridOptions

    def __init__(self, topology: Topology, options: Any = None, *,
                 timeout_s: float = 300.0) -> None:
        super().__init__(topology, options, timeout_s=timeout_s)
        degrees = self.options.degrees(topology)
        inner: PipelineStrategy | FSDPStrategy
        if degrees.pipeline_degree > 1:
            inner = PipelineStrategy(topology, PipelineOptions(**self.options.pipeline),
                                     timeout_s=timeout_s, degrees=degrees,
                                     fsdp=FSDPOptions(**self.options.fsdp),
                                     tp=TPOptions(**self.options.tensor))
        else:
            inner = FSDPStrategy(topology, FSDPOptions(**self.options.fsdp),
                                 timeout_s=timeout_s, degrees=degrees)
        self.inner = inner

    def notice(self) -> str | None:
        d = self.inner.mesh.degrees
        return (f"strategy 'hybrid': pipeline {d.pipeline_degree} x replicate "
                f"{d.replicate_degree} x shard {d.shard_degree} x tensor {d.tensor_degree}")

    def evaluation_batches(self, batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        return evaluation_batches(self.inner, batches)
