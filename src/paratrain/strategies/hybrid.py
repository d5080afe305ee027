"""``hybrid``: a 2-D layout on a :class:`~paratrain.distributed.mesh.ParallelMesh`.

Two combinations are supported, chosen by the degrees:

* data parallel x pipeline (``pipeline_degree > 1``): ``replicate_degree``
  copies of a ``pipeline_degree``-stage pipeline; each stage's gradients are
  averaged over its replicas. 4 ranks = 2 DP x 2 PP.
* HSDP (``pipeline_degree == 1``): parameters sharded over ``shard_degree``
  ranks (by default the processes of one node) and replicated across nodes, so
  the all-gathers stay inside a node and only gradient all-reduces cross nodes.

The degrees are validated once, against the world size, with an error that
names the bad degree. The work is done by :class:`PipelineStrategy` or
:class:`FSDPStrategy` on the mesh; this class only builds the layout and
forwards the :class:`Strategy` interface to them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.mesh import ParallelDegrees
from paratrain.distributed.topology import Topology
from paratrain.strategies.base import Strategy
from paratrain.strategies.fsdp import FSDPOptions, FSDPStrategy
from paratrain.strategies.pipeline.strategy import PipelineOptions, PipelineStrategy


@dataclass(frozen=True, kw_only=True)
class HybridOptions:
    """Options of the ``hybrid`` strategy. Degrees left as None are inferred."""

    pipeline_degree: int = 1
    """Pipeline stages; > 1 selects data parallel x pipeline."""

    shard_degree: int | None = None
    """FSDP shard size (HSDP only); default: the processes per node."""

    replicate_degree: int | None = None
    """Replicas; default: world size / (pipeline_degree x shard_degree)."""

    pipeline: dict[str, Any] = field(default_factory=dict)
    """Options of the pipeline (see ``PipelineOptions``), e.g. ``{"schedule": "gpipe"}``."""

    fsdp: dict[str, Any] = field(default_factory=dict)
    """Options of the sharding (see ``FSDPOptions``), e.g. ``{"reshard_after_forward": False}``."""

    def __post_init__(self) -> None:
        if not isinstance(self.pipeline_degree, int) or self.pipeline_degree < 1:
            raise ValueError(f"pipeline_degree must be an integer >= 1, got {self.pipeline_degree!r}")
        if self.pipeline_degree > 1 and self.shard_degree not in (None, 1):
            raise ValueError(
                f"shard_degree={self.shard_degree} with pipeline_degree={self.pipeline_degree}: "
                "sharding inside a pipeline is not supported; use shard_degree=1"
            )
        if self.pipeline and self.pipeline_degree == 1:
            raise ValueError("pipeline options need pipeline_degree > 1")
        if self.fsdp and self.pipeline_degree > 1:
            raise ValueError("fsdp options apply only with pipeline_degree=1 (HSDP)")

    def degrees(self, topology: Topology) -> ParallelDegrees:
        """The validated layout for ``topology``."""
        shard = self.shard_degree
        if shard is None:
            shard = 1 if self.pipeline_degree > 1 else topology.local_world_size
        return ParallelDegrees.infer(world_size=topology.world_size,
                                     pipeline_degree=self.pipeline_degree,
                                     shard_degree=shard, replicate_degree=self.replicate_degree)


class HybridStrategy(Strategy):
    """Data parallel x pipeline, or sharded within a node x replicated across nodes."""

    name = "hybrid"
    Options = HybridOptions

    def __init__(self, topology: Topology, options: Any = None) -> None:
        super().__init__(topology, options)
        degrees = self.options.degrees(topology)
        if degrees.pipeline_degree > 1:
            inner: Strategy = PipelineStrategy(
                topology, PipelineOptions(**self.options.pipeline), degrees=degrees)
        else:
            inner = FSDPStrategy(topology, FSDPOptions(**self.options.fsdp), degrees=degrees)
        self.inner = inner
        self.degrees = degrees
        self.replicated = inner.replicated  # type: ignore[misc]

    def notice(self) -> str | None:
        d = self.degrees
        return (f"strategy 'hybrid': pipeline {d.pipeline_degree} x replicate "
                f"{d.replicate_degree} x shard {d.shard_degree}")

    # Everything below forwards to the strategy that implements the layout.
    @property
    def data_parallel_rank(self) -> int:
        return self.inner.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        return self.inner.data_parallel_size

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        return self.inner.data_parallel_group

    def configure_precision(self, precision: Any) -> None:
        self.inner.configure_precision(precision)

    def setup_model(self, model: nn.Module) -> nn.Module:
        return self.inner.setup_model(model)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return self.inner.setup_optimizer(optimizer)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.inner.unwrap(model)

    def checkpoint_module(self, model: nn.Module) -> nn.Module:
        return self.inner.checkpoint_module(model)

    @property
    def partial_model(self) -> bool:
        return self.inner.partial_model

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        self.inner.load_model_state_dict(model, state)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict) -> None:
        self.inner.load_optimizer_state_dict(model, optimizer, state)

    def backward(self, loss: torch.Tensor) -> None:
        self.inner.backward(loss)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.inner.optimizer_step(optimizer)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return self.inner.no_sync(model)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        return self.inner.clip_grad_norm(model, max_norm)

    def evaluation_batches(self, batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        return self.inner.evaluation_batches(batches)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor] | None:
        """The unsharded model state (HSDP only; a pipeline stage holds only its layers)."""
        full = getattr(self.inner, "full_state_dict", None)
        return full(model) if full is not None else None

    def teardown(self) -> None:
        self.inner.teardown()
