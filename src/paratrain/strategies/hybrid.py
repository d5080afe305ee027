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
names the bad degree. ``hybrid`` is a :class:`~paratrain.strategies.compose.LayoutPreset`:
it returns the :class:`PipelineStrategy` or :class:`FSDPStrategy` that runs the degrees,
so each layout has one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from paratrain.distributed.mesh import ParallelDegrees
from paratrain.distributed.topology import Topology
from paratrain.strategies.compose import LayoutPreset
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
            shard = default_shard_degree(self.pipeline_degree, topology.local_world_size)
        return ParallelDegrees.infer(world_size=topology.world_size,
                                     pipeline_degree=self.pipeline_degree,
                                     shard_degree=shard, replicate_degree=self.replicate_degree,
                                     tensor_degree=self.tensor_degree)


def default_shard_degree(pipeline_degree: int, local_world_size: int) -> int:
    """``hybrid``'s shard degree when none is given: a node's processes (HSDP) without a
    pipeline, 1 with one (the stages already split the model)."""
    return 1 if pipeline_degree > 1 else local_world_size


def _build(topology: Topology, options: HybridOptions,
           timeout_s: float) -> tuple[PipelineStrategy | FSDPStrategy, ParallelDegrees]:
    degrees = options.degrees(topology)
    if degrees.pipeline_degree > 1:
        return PipelineStrategy(topology, PipelineOptions(**options.pipeline),
                                timeout_s=timeout_s, degrees=degrees,
                                fsdp=FSDPOptions(**options.fsdp),
                                tp=TPOptions(**options.tensor)), degrees
    return FSDPStrategy(topology, FSDPOptions(**options.fsdp), timeout_s=timeout_s,
                        degrees=degrees), degrees


HYBRID = LayoutPreset(name="hybrid", Options=HybridOptions, build=_build)
"""Pipeline x data parallel (x FSDP, x TP), or sharded within a node x replicated across
nodes: the strategy that runs those degrees, named ``hybrid``."""
