"""The layout strategy: one object that runs every composed layout of degrees.

``pp x dp_replicate x dp_shard x cp x tp`` (+ ``ep``, borrowed from ``dp_shard x cp``) is
resolved once into :class:`~paratrain.distributed.mesh.ParallelDegrees`; this strategy
builds the one :class:`~paratrain.distributed.mesh.ParallelMesh` from them and applies the
parallelisms with :func:`~paratrain.strategies.layout.apply.parallelize` (after the
pipeline split when ``pp > 1``). Replicas average gradients one way, as an axis of FSDP's
mesh (HSDP; shard 1 when there are only replicas). The named presets (``fsdp``, ``zero2``,
``tp``, ``fsdp_tp``, ``pipeline``, ``hybrid``) are layouts run by it
(:mod:`.presets`); only a pure-replicate layout keeps ``ddp``.

Two groups, two jobs: the *batch* group (``data_parallel_group``: replicate x shard)
decides which data a rank reads; the *loss* group (``loss_group``: batch x cp) is what
losses and metrics are averaged over.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.checkpoint.meta_init import materialise, on_meta
from paratrain.checkpoint.sharded import lockstep_batches, parameter_names
from paratrain.distributed.mesh import ParallelDegrees, ParallelMesh
from paratrain.distributed.topology import Topology
from paratrain.parallel.degrees import Parallel
from paratrain.parallel.options import Pipeline, Sharding
from paratrain.strategies.base import Strategy
from paratrain.strategies.capabilities import (
    Compiles,
    LockstepEvaluation,
    OrdersParallelisms,
    PrecisionPolicy,
    ShardedState,
    ShardsOnMeta,
)
from paratrain.strategies.clipping import clip_grad_norm
from paratrain.strategies.dtensor_params import (
    DTensorParameters,
    gradient_sync_disabled,
    mixed_precision_policy,
    whole_model_state,
)
from paratrain.strategies.layout.apply import Applied, parallelize
from paratrain.strategies.pipeline.module import PipelineModule
from paratrain.strategies.pipeline.stages import PipelineStages, check_stage_options
from paratrain.strategies.tensor.apply import complete_gradients
from paratrain.strategies.tensor.sequence import find_output_layer, loss_parallel_context

__all__ = ["LayoutStrategy"]


class LayoutStrategy(DTensorParameters, Strategy, ShardedState, LockstepEvaluation,
                     PrecisionPolicy, Compiles, ShardsOnMeta, OrdersParallelisms):
    """Runs ``layout`` resolved to ``degrees`` on this process.

    Args:
        topology: this process's place in the job.
        layout: the degrees' typed options (``tensor``, ``sharding``, ``pipeline``,
            ``context``).
        degrees: ``layout`` resolved for this job (``Parallel.resolve``).
        name: what the run, its messages and checkpoints call it (a preset's name).
        timeout_s: seconds to wait for a peer.
    """

    name = "layout"

    def __init__(self, topology: Topology, layout: Parallel, degrees: ParallelDegrees, *,
                 name: str = "layout", timeout_s: float = 300.0) -> None:
        super().__init__(topology, None, timeout_s=timeout_s)
        self.name = name
        self.layout = layout
        self.mesh = ParallelMesh(degrees, topology)
        self.active = topology.is_distributed
        self.pipeline: PipelineStages | None = None
        if degrees.pipeline_degree > 1:
            options = layout.pipeline if layout.pipeline is not None else Pipeline()
            check_stage_options(self.mesh, options, sharding=layout.sharding,
                                tensor=layout.tensor)
            self.pipeline = PipelineStages(self.mesh, options, device=topology.device,
                                           rank=topology.rank)
        self.applied = Applied()
        self._mp_policy: Any = None
        self._checkpointing: Any = None
        # Holds torch's loss_parallel() from setup_model to teardown (loss_parallel=True).
        self._loss_context = contextlib.ExitStack()
        self._sync_disabled = False
        self._names: dict[int, str] = {}
        self._params: dict[str, nn.Parameter] = {}

    @property
    def degrees(self) -> ParallelDegrees:
        return self.mesh.degrees

    def notice(self) -> str | None:
        if not self.active:
            return (f"strategy {self.name!r} in one process: nothing to split, running as "
                    "'single'")
        return self.layout_line

    # -- layout -------------------------------------------------------------------
    @property
    def data_parallel_rank(self) -> int:
        return self.mesh.data_parallel_rank

    @property
    def data_parallel_size(self) -> int:
        return self.degrees.data_parallel_degree

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        if self.data_parallel_size == 1 or not self.active:
            return None
        return self.mesh.data_parallel_group

    @property
    def loss_size(self) -> int:
        return self.degrees.loss_degree

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        if self.loss_size == 1 or not self.active:
            return None
        return self.mesh.loss_group

    @property
    def random_stream_rank(self) -> int:
        # Tensor-parallel peers share dropout masks; cp ranks hold other positions.
        return self.mesh.global_rank(tensor=0)

    def configure_precision(self, precision: Any) -> None:
        if precision.mode == "16-mixed" and self.pipeline is not None:
            # Each stage would check only its own gradients for inf and could skip alone.
            raise ValueError("precision '16-mixed' is not supported with a pipeline; "
                             "use 'bf16-mixed'")
        self._mp_policy = mixed_precision_policy(precision,
                                                 refuse_fp16="with sharded or split layers")

    def shards_on_meta(self) -> bool:
        # Tensor, expert and pipeline parallel cut real weights: only FSDP shards on meta.
        d = self.degrees
        return d.pipeline_degree == d.tensor_degree == d.expert_degree == 1

    def configure_activation_checkpointing(self, spec: Any) -> None:
        self._checkpointing = spec

    def cuda_graphs_blocker(self) -> str | None:
        return "FSDP's all-gathers and frees run between the graphs" if self.active else None

    # -- model and optimizer --------------------------------------------------------
    def setup_model(self, model: nn.Module) -> nn.Module:
        offload = bool(self.layout.sharding and self.layout.sharding.offload) and self.active
        # With offload, fully_shard moves each unit to the device only to shard it; a
        # model on the meta device is sharded there and only the shards get memory.
        meta = on_meta(model)
        if meta and self.pipeline is not None:
            raise ValueError(f"strategy {self.name!r} splits a model built on the CPU only; "
                             "build it without the meta device (or use fsdp)")
        if not offload and not meta:
            model = model.to(self.topology.device)
        names = parameter_names(model)
        if not self.active:
            return self._single(model, names)
        # The optimizer names a tied tensor once; a later stage holds it under another name.
        aliases = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}
        parts = self.pipeline.split(model) if self.pipeline is not None else None
        target = parts.whole if parts is not None else model
        tensor = self.layout.tensor
        plan = None
        if self.degrees.tensor_degree > 1:
            from paratrain.strategies.tensor.plan import resolve_plan
            from paratrain.strategies.tensor.sequence import block_container

            plan = resolve_plan(target, tensor.plan if tensor else None)
            if tensor and tensor.sequence_parallel:
                block_container(target, plan)
        output_layer = (find_output_layer(target, tensor.output_layer)
                        if tensor and tensor.loss_parallel else None)
        sharding = self.layout.sharding or Sharding()
        if parts is not None:
            self.pipeline.tie(parts, frozenset(plan or ()))
            sharding = self.pipeline.sharding(target, sharding)
        layout = self.layout if sharding is self.layout.sharding else \
            _with_sharding(self.layout, sharding)
        self.applied = parallelize(target, self.mesh, layout, plan=plan,
                                   output_layer=output_layer, mp_policy=self._mp_policy,
                                   checkpoint_activations=self._checkpointing,
                                   compile_options=self._compile,
                                   offload_policy=self._offload_policy(offload))
        if self.applied.loss_parallel:
            self._loss_context.enter_context(loss_parallel_context())
        if meta:
            materialise(model, "cpu" if offload else self.topology.device)
        if self.data_parallel_size > 1:
            self.mesh.data_parallel_group  # noqa: B018  (collective: built now, by all)
        if self.loss_size > self.data_parallel_size:
            self.mesh.loss_group  # noqa: B018
        if parts is not None:
            model = self.pipeline.wrap(parts)
            model.tied_names = {n: a for n, a in aliases.items() if n != a}
            self._names.update(names)
            self._params.update({aliases.get(n, n): p
                                 for n, p in self.checkpoint_module(model).named_parameters()})
            return model
        self._remember(model, names)
        return model

    def _single(self, model: nn.Module, names: dict[int, str]) -> nn.Module:
        from paratrain.activation_checkpointing import apply_activation_checkpointing
        from paratrain.compile import compile_model

        if self._checkpointing is not None:
            apply_activation_checkpointing(model, self._checkpointing)
        if self._compile is not None:
            compile_model(model, self._compile)
        if on_meta(model):
            materialise(model, self.topology.device)
        self._remember(model, names)
        return model

    def _offload_policy(self, offload: bool) -> Any:
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

        if not offload:
            return OffloadPolicy()
        # Pinned host memory makes the copies to the GPU asynchronous; it needs CUDA.
        return CPUOffloadPolicy(pin_memory=self.topology.device.type == "cuda")

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def checkpoint_module(self, model: nn.Module) -> nn.Module:
        return model.stage_module if isinstance(model, PipelineModule) else model

    @property
    def partial_model(self) -> bool:
        return self.pipeline is not None

    # -- the step -------------------------------------------------------------------
    def local_batch(self, batch: Any) -> Any:
        context = self.applied.context
        return batch if context is None else context.slice_batch(batch)

    def mean_loss_factor(self) -> float:
        context = self.applied.context
        return 1.0 if context is None else context.loss_factor()

    def backward(self, loss: torch.Tensor) -> None:
        try:
            if self.pipeline is not None:
                self.pipeline.backward(loss, sync=not self._sync_disabled)
            else:
                loss.backward()
        finally:
            if self.applied.context is not None:
                self.applied.context.end_step()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if self.pipeline is not None:
            # The schedule drives FSDP's reduction per micro-batch; tied copies wait.
            return self._ties_wait()
        if not self.applied.sharded:
            # Tensor-parallel all-reduces carry activations, not gradients: they never wait.
            return contextlib.nullcontext()
        return gradient_sync_disabled(model)

    @contextlib.contextmanager
    def _ties_wait(self) -> Iterator[None]:
        self._sync_disabled = True
        try:
            yield
        finally:
            self._sync_disabled = False

    def evaluation_batches(self, batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        if not self.active or (self.data_parallel_size == 1 and self.pipeline is None):
            # Every rank reads the same batches: they run the same forwards already.
            yield from ((batch, True) for batch in batches)
            return
        if self.pipeline is not None and self.degrees.shard_degree == 1:
            # The stages of one pipeline read the same batches; replicas never talk in forward.
            yield from ((batch, True) for batch in batches)
            return
        yield from lockstep_batches(batches, device=self.topology.device)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.layout.tensor and self.layout.tensor.sequence_parallel:
            complete_gradients(p for group in optimizer.param_groups for p in group["params"])
        optimizer.step()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        if self.layout.tensor and self.layout.tensor.sequence_parallel:
            complete_gradients(model.parameters())
        if self.pipeline is not None and self.active:
            return self.pipeline.clip_grad_norm(model, max_norm)
        # Split experts are DTensors over expert_shard x expert: their squares are summed
        # over both, like every other sharded gradient.
        return clip_grad_norm(model.parameters(), max_norm)

    # -- whole state ----------------------------------------------------------------
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        module = self.checkpoint_module(model)
        if not self.active:
            return {k: v.detach().clone() for k, v in module.state_dict().items()}
        local = whole_model_state(module)  # collective over the stage's mesh
        if self.pipeline is None:
            return local
        return self.pipeline.gather_stages(local)


    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        from paratrain.checkpoint.sharded import load_full_model_state

        # A one-file checkpoint holds whole tensors (every stage): each rank keeps its piece.
        load_full_model_state(self.checkpoint_module(model), state,
                              partial=self.pipeline is not None)

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict) -> None:
        from paratrain.checkpoint.sharded import load_full_optimizer_state

        load_full_optimizer_state(self.checkpoint_module(model), optimizer, state)

    def teardown(self) -> None:
        self._loss_context.close()
        super().teardown()


def _with_sharding(layout: Parallel, sharding: Sharding) -> Parallel:
    from dataclasses import replace

    # Parallel refuses sharding options without dp_shard > 1; a stage's units are
    # decided here, after validation, so the replaced copy skips nothing else.
    copy = replace(layout, sharding=None)
    object.__setattr__(copy, "sharding", sharding)
    return copy
