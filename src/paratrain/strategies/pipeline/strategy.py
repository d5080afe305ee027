"""``pipeline``: the model's layers split into stages, one stage per rank.

Each rank holds only its stage's parameters, gradients and optimizer state.
A batch is split into micro-batches that flow through the stages under a
``torch.distributed.pipelining`` schedule: GPipe (all forwards, then all
backwards), 1F1B (one forward, one backward in the steady state, so fewer
activations are alive) or interleaved 1F1B (``v`` smaller stages per rank, in a
loop). Stages idle while the pipeline fills and drains: the bubble is
``(p - 1) / (m + p - 1)`` of the step for ``p`` stages and ``m`` micro-batches,
``(p - 1) / (v m + p - 1)`` interleaved.

The user's loop does not change: see :mod:`.deferred` for how
``loss = F.cross_entropy(model(x), y); run.backward(loss)`` becomes one
schedule step. ``nn.Sequential`` models are split automatically (balanced by
parameter count) or at ``split_points``; models with an embedding, a ``ModuleList``
of blocks and a head describe themselves with a ``pipeline_layout()`` (see
:mod:`.layout`) and are balanced by measured compute; Hugging Face models are described
by their model adapter (:mod:`.adapted`). Tied parameters on two stages stay one
parameter (:mod:`.ties`).

Every stage reads the same batches: the data-parallel size is the number of
pipeline replicas (1 here, more under ``hybrid``), not the world size.

Under ``hybrid`` a stage can also be split further (the 3-D layout, see
:mod:`.split_stages`). The ``torch.distributed.pipelining`` stage drives a sharded stage
itself: it delays FSDP's gradient reduction to the last micro-batch of a step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.checkpoint.sharded import (
    load_full_model_state,
    load_full_optimizer_state,
    lockstep_batches,
    parameter_names,
    rebuild_optimizer,
)
from paratrain.compile import CompileOptions, compile_forward
from paratrain.distributed.dtensor import local_piece
from paratrain.distributed.mesh import ParallelDegrees, ParallelMesh
from paratrain.distributed.topology import Topology
from paratrain.strategies.base import Strategy
from paratrain.strategies.capabilities import (
    Compiles,
    LockstepEvaluation,
    PrecisionPolicy,
    ShardedState,
)
from paratrain.strategies.clipping import clip_grad_norm, scale_gradients
from paratrain.strategies.dtensor_params import mixed_precision_policy, whole_model_state
from paratrain.strategies.fsdp import FSDPOptions
from paratrain.strategies.pipeline.adapted import (
    AdaptedStage,
    adapted_layout,
    prepare_inputs,
    stage_sharding,
)
from paratrain.strategies.pipeline.layout import StageParts, layout_of, split_model, stage_layers
from paratrain.strategies.pipeline.module import PipelineModule
from paratrain.strategies.pipeline.outputs import OutputSpec
from paratrain.strategies.pipeline.split_stages import (
    check_split_options,
    split_stage,
    stage_plan,
)
from paratrain.strategies.pipeline.ties import TiedCopies
from paratrain.strategies.tensor.strategy import TPOptions

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True, kw_only=True)
class PipelineOptions:
    """Options of the ``pipeline`` strategy."""

    schedule: str = "1f1b"
    """``gpipe``, ``1f1b`` or ``interleaved_1f1b`` (same gradients; 1F1B keeps fewer
    activations alive; interleaved 1F1B runs several smaller stages per rank, in a loop,
    so the pipeline fills and drains faster)."""

    stages_per_rank: int | None = None
    """Stages each rank runs: with ``interleaved_1f1b`` 2 or more (default 2), else 1.
    Rank ``r`` of ``p`` runs stages ``r, r + p, r + 2p, ...``."""

    num_microbatches: int = 4
    """Micro-batches per step. More shrinks the bubble but makes each one smaller.
    A batch that does not divide uses the largest divisor below this number."""

    split_points: tuple[int, ...] | None = None
    """Indices of the ``nn.Sequential`` children (or, for a model with a
    ``pipeline_layout()``, of its blocks) where stages 1.. begin; None balances the
    stages by parameter count (by measured compute for a layout with a sample input)."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if not isinstance(self.num_microbatches, int) or self.num_microbatches < 1:
            raise ValueError(
                f"num_microbatches must be an integer >= 1, got {self.num_microbatches!r}"
            )
        per_rank = self.stages_per_rank
        if per_rank is not None and (not isinstance(per_rank, int) or per_rank < 1):
            raise ValueError(f"stages_per_rank must be an integer >= 1, got {per_rank!r}")
        if self.schedule == "interleaved_1f1b" and per_rank == 1:
            raise ValueError("schedule 'interleaved_1f1b' needs stages_per_rank >= 2; "
                             "use schedule '1f1b' for one stage per rank")
        if self.schedule != "interleaved_1f1b" and per_rank not in (None, 1):
            raise ValueError(f"stages_per_rank={per_rank} needs schedule 'interleaved_1f1b'")
        points = self.split_points
        if points is not None and (
            not all(isinstance(p, int) and p > 0 for p in points)
            or list(points) != sorted(set(points))
        ):
            raise ValueError(
                f"split_points must be increasing positive child indices, got {points!r}"
            )

    @property
    def num_local_stages(self) -> int:
        """Stages each rank runs."""
        return self.stages_per_rank or (2 if self.schedule == "interleaved_1f1b" else 1)


class PipelineStrategy(Strategy, ShardedState, PrecisionPolicy, LockstepEvaluation,
                       Compiles):
    """Split the model into stages over the ranks; micro-batches flow through them.

    Args:
        topology: this process's place in the job.
        options: :class:`PipelineOptions`.
        degrees: the layout; by default one pipeline over all ranks. With
            ``replicate_degree > 1`` each stage's gradients are also averaged over
            the replicas (data parallel x pipeline); with ``shard_degree > 1`` each
            stage is sharded with FSDP2, with ``tensor_degree > 1`` split by tensor
            parallel.
        fsdp: how a sharded stage is wrapped (``shard_degree > 1``).
        tp: the tensor-parallel plan (``tensor_degree > 1``).
    """

    name = "pipeline"
    Options = PipelineOptions

    def __init__(self, topology: Topology, options: Any = None, *, timeout_s: float = 300.0,
                 degrees: ParallelDegrees | None = None, fsdp: FSDPOptions | None = None,
                 tp: TPOptions | None = None) -> None:
        super().__init__(topology, options, timeout_s=timeout_s)
        degrees = degrees or ParallelDegrees(pipeline_degree=topology.world_size)
        self.fsdp_options = fsdp or FSDPOptions()
        self.tp_options = tp or TPOptions()
        self.mesh = ParallelMesh(degrees, topology)
        check_split_options(degrees, num_local_stages=self.options.num_local_stages,
                            fsdp=self.fsdp_options, tp=self.tp_options)
        self.active = degrees.pipeline_degree > 1
        # Parameters become DTensors: gradients and norms go through DTensor collectives.
        self.dtensor_stages = self.active and (degrees.shard_degree > 1
                                               or degrees.tensor_degree > 1)
        self._mp_policy: Any = None
        self._names: dict[int, str] = {}
        self._params: dict[str, nn.Parameter] = {}
        self._ties: TiedCopies | None = None  # tied parameters on several stages
        self._prepare_inputs: Callable[[tuple, dict], tuple[tuple, dict]] | None = None
        self._adapted_blocks: str | None = None  # the blocks of an AdaptedStage
        self._outputs: OutputSpec | None = None  # what a Hugging Face model returns
        self._sync_disabled = False

    def notice(self) -> str | None:
        if self.active:
            return super().notice()
        return "strategy 'pipeline' with one stage: nothing to split, running unpipelined"

    def configure_precision(self, precision: Any) -> None:
        if precision.mode == "16-mixed" and self.active:
            # Each stage would check only its own gradients for inf and could skip alone.
            raise ValueError("precision '16-mixed' is not supported with a pipeline; "
                             "use 'bf16-mixed'")
        if self.dtensor_stages:
            self._mp_policy = mixed_precision_policy(precision, refuse_fp16="with a pipeline")

    # -- layout ---------------------------------------------------------------------
    @property
    def data_parallel_rank(self) -> int:
        return self.mesh.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        return self.mesh.degrees.data_parallel_degree

    @property
    def random_stream_rank(self) -> int:
        return self.mesh.global_rank(tensor=0)

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        if self.data_parallel_size == 1 or not self.active:
            return None
        return self.mesh.data_parallel_group

    # -- model ------------------------------------------------------------------------
    def setup_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.topology.device)
        names = parameter_names(model)
        # The optimizer names a tied tensor once; a later stage holds it under another name.
        aliases = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
        if self.active:
            stages = self.mesh.degrees.pipeline_degree
            parts = self._stage(model, stages)
            plan = stage_plan(parts.whole, self.mesh, self.tp_options)
            # A collective: the ranks agree on the ties and build the groups of the copies.
            self._ties = TiedCopies(parts.ties, self.mesh, split=frozenset(plan or ()),
                                    device=self.topology.device)
            sharding = stage_sharding(parts.whole, self._adapted_blocks, self.fsdp_options)
            split_stage(parts.whole, self.mesh, sharding=sharding, plan=plan,
                        mp_policy=self._mp_policy)
            self._ties.bind(parts.whole)
            if self.data_parallel_size > 1:
                self.mesh.data_parallel_group  # noqa: B018  (collective: built now, by all)
            model = PipelineModule(parts.whole, chunks=parts.chunks,
                                   stage_indices=self._stage_indices(stages),
                                   num_stages=stages * self.options.num_local_stages,
                                   group=self.mesh.group("pipeline"), device=self.topology.device,
                                   schedule=self.options.schedule,
                                   num_microbatches=self.options.num_microbatches,
                                   sharded=self.mesh.degrees.shard_degree > 1,
                                   prepare_inputs=self._prepare_inputs,
                                   outputs=self._outputs)
            model.tied_names = {n: a for n, a in aliases.items() if n != a}
        elif self._compile is not None:
            compile_forward(model, self._compile)
        self._names.update(names)
        self._params.update({aliases.get(n, n): p
                             for n, p in self.checkpoint_module(model).named_parameters()})
        return model

    def configure_compile(self, options: CompileOptions) -> None:
        if self.active:
            # Not verified with the pipelining schedules: refused rather than risk a hang.
            raise ValueError("compile with strategy 'pipeline' on several stages is not "
                             "supported yet; use compile=False")
        super().configure_compile(options)

    def _stage_indices(self, ranks: int) -> list[int]:
        # Looped placement (as torch.distributed.pipelining expects): rank r runs stages
        # r, r + p, r + 2p, ...
        return [self.mesh.pipeline_rank + k * ranks for k in range(self.options.num_local_stages)]

    def _stage(self, model: nn.Module, ranks: int) -> StageParts:
        stages, indices = ranks * self.options.num_local_stages, self._stage_indices(ranks)
        if isinstance(model, nn.Sequential):
            return stage_layers(model, num_stages=stages, stage_indices=indices,
                                split_points=self.options.split_points)
        layout = layout_of(model)
        if layout is None:  # its model adapter describes it, or one line names the ways
            model, layout = adapted_layout(model)
            if isinstance(model, AdaptedStage):
                self._prepare_inputs = partial(prepare_inputs, model.model_class)
                self._adapted_blocks = layout.blocks
                self._outputs = model.outputs
        return split_model(model, layout, num_stages=stages, stage_indices=indices,
                           split_points=self.options.split_points, device=self.topology.device,
                           agree=self._agree)

    def _agree(self, measure: Callable[[], list[float]], count: int) -> list[float]:
        # Timings differ per process: rank 0 measures and decides the split for every
        # pipeline; the others only receive it.
        if self.topology.rank == 0:
            tensor = torch.tensor(measure(), dtype=torch.float64, device=self.topology.device)
        else:
            tensor = torch.zeros(count, dtype=torch.float64, device=self.topology.device)
        dist.broadcast(tensor, src=0)
        return tensor.tolist()

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not self.active:
            return optimizer
        # Only this stage's parameters: the others live (and are updated) on other ranks.
        return rebuild_optimizer(optimizer, self._names, self._params)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def checkpoint_module(self, model: nn.Module) -> nn.Module:
        return model.stage_module if isinstance(model, PipelineModule) else model

    @property
    def partial_model(self) -> bool:
        return self.active

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Every stage's state, in stage order, on every rank (collective over the pipeline)."""
        module = self.checkpoint_module(model)
        if self.dtensor_stages:
            local = whole_model_state(module)  # collective over the stage's mesh
        else:
            local = {k: v.detach().clone() for k, v in module.state_dict().items()}
        if not self.active:
            return local
        # Pickled through CPU: a stage's tensors must not name another rank's device.
        parts: list[Any] = [None] * self.mesh.degrees.pipeline_degree
        dist.all_gather_object(parts, {k: v.cpu() for k, v in local.items()},
                               group=self.mesh.group("pipeline"))
        device = self.topology.device
        return {k: v.to(device) for part in parts for k, v in part.items()}

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        # A one-file (replicated) checkpoint holds every stage: take this stage's entries.
        load_full_model_state(self.checkpoint_module(model), state, partial=self.active)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict) -> None:
        load_full_optimizer_state(self.checkpoint_module(model), optimizer, state)

    # -- step -------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor) -> None:
        if not self.active:
            loss.backward()
            return
        module = self._module_of(loss)
        module.run_step(loss)
        if not self._sync_disabled:
            if self._ties:
                self._ties.sum_gradients()
            self._average_gradients(module)

    def _module_of(self, loss: Any) -> PipelineModule:
        from paratrain.strategies.pipeline.deferred import loss_chain

        root, _ = loss_chain(loss)
        return root.context.module

    def _average_gradients(self, module: PipelineModule) -> None:
        if self.data_parallel_size == 1 or self.mesh.degrees.shard_degree > 1:
            return  # one replica, or FSDP reduced them already (the stage ran its hooks)
        # A tensor-parallel gradient's local piece matches its replicas' (same tensor rank).
        grads = [local_piece(p.grad) for p in module.parameters() if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=self.data_parallel_group)
        flat /= self.data_parallel_size
        offset = 0
        for grad in grads:
            grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
            offset += grad.numel()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return self._no_sync()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        # Replicas average gradients only on the last micro-step of an accumulation group.
        self._sync_disabled = True
        try:
            yield
        finally:
            self._sync_disabled = False

    def evaluation_batches(self, batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        if self.active and self.mesh.degrees.shard_degree > 1:
            # A sharded stage's forward all-gathers across its data-parallel ranks.
            yield from lockstep_batches(batches, device=self.topology.device)
            return
        # The stages of one pipeline read the same batches; replicas never talk in forward.
        yield from ((batch, True) for batch in batches)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        # The global norm covers every stage's gradients, a tied tensor's once.
        params = [p for p in model.parameters() if p.grad is not None]
        ties = self._ties
        norm = clip_grad_norm(ties.counted(params) if ties else params, max_norm,
                              across=self.mesh.group("pipeline") if self.active else None,
                              device=self.topology.device)
        if ties:  # the copies the norm left out, scaled alike
            scale_gradients(ties.copies(params), norm, max_norm)
        return norm

    def teardown(self) -> None:
        # The stage's parameters must not outlive the process group (its schedule holds it).
        self._names.clear()
        self._params.clear()

