"""``tp`` and ``fsdp_tp``: tensor parallelism through DTensor, alone or under FSDP2.

``tp`` splits the planned linear layers (see :mod:`paratrain.strategies.tensor.plan`)
over every rank; all ranks read the same batch (data-parallel size 1). ``fsdp_tp`` lays
the job out as ``shard x tensor`` on one :class:`~paratrain.distributed.mesh.ParallelMesh`:
tensor parallel within groups of ``tensor_degree`` consecutive ranks, FSDP over the
``shard`` axis, which reads different data.

Parallelisms are applied in a fixed order, each a small function over the mesh slice it
needs: tensor parallel (``parallelize_module``), then FSDP (``fully_shard``, which then
shards the TP DTensors once more along the data axis). Activation checkpointing, when
asked for, is applied by ``run.prepare`` before either; it only wraps ``forward``, so
module names (and the plan) are unchanged.

Example::

    run = paratrain.Run(strategy="fsdp_tp", strategy_options={
        "tensor_degree": 2, "plan": {"blocks.*.attn.[qkv]": "colwise",
                                     "blocks.*.attn.proj": "rowwise"}})
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.checkpoint.sharded import parameter_names
from paratrain.distributed.mesh import ParallelDegrees, ParallelMesh
from paratrain.distributed.topology import Topology
from paratrain.strategies.base import Strategy
from paratrain.strategies.capabilities import LockstepEvaluation, PrecisionPolicy, ShardedState
from paratrain.strategies.dtensor_params import (
    DTensorParameters,
    mixed_precision_policy,
    shard_units,
)
from paratrain.strategies.fsdp import FSDPOptions, wrap_predicate
from paratrain.strategies.tensor.plan import (
    check_divisible,
    parallel_style,
    resolve_plan,
    shard_heads,
    validate_plan,
)
from paratrain.strategies.tensor.sequence import (
    apply_loss_parallel,
    apply_sequence_parallel,
    block_container,
    find_output_layer,
    loss_parallel_context,
)


@dataclass(frozen=True, kw_only=True)
class TPOptions:
    """Options of the ``tp`` strategy."""

    plan: dict[str, str] | None = None
    """``{glob over module names: style}`` (``"colwise"``, ``"rowwise"``, ...: see
    :mod:`paratrain.strategies.tensor.plan`); None: the plan transformers ships with the
    model, else a registered adapter's, else the automatic plan for standard blocks."""

    sequence_parallel: bool = False
    """Shard the residual stream and the blocks' norms over the sequence between the split
    layers (see :mod:`paratrain.strategies.tensor.sequence`)."""

    loss_parallel: bool = False
    """Split the output layer over the vocabulary and keep its logits sharded (a DTensor);
    ``F.cross_entropy`` on them works as written."""

    output_layer: str | None = None
    """The output linear loss parallel splits; None: the top-level ``head``, ``lm_head`` or
    ``output``."""

    def __post_init__(self) -> None:
        validate_plan(self.plan)
        for field in ("sequence_parallel", "loss_parallel"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(f"{field} must be True or False, got {getattr(self, field)!r}")
        if self.output_layer is not None and (not isinstance(self.output_layer, str)
                                              or not self.output_layer):
            raise ValueError(f"output_layer must be a module name, got {self.output_layer!r}")
        if self.output_layer is not None and not self.loss_parallel:
            raise ValueError("output_layer is only used with loss_parallel=True; set both")

    def degrees(self, topology: Topology) -> ParallelDegrees:
        """``tp``: every rank splits the layers (one data-parallel rank)."""
        return ParallelDegrees(tensor_degree=topology.world_size)

    def sharding(self) -> FSDPOptions:
        """FSDP options over the data axes (none are sharded under ``tp``)."""
        return FSDPOptions()


@dataclass(frozen=True, kw_only=True)
class FSDPTPOptions(TPOptions):
    """Options of the ``fsdp_tp`` strategy (``shard x tensor``)."""

    tensor_degree: int = 2
    """Consecutive ranks that split each planned layer; the world size divided by it is
    the FSDP shard degree (the ranks that read different data)."""

    reshard_after_forward: bool = True
    """As ``FSDPOptions.reshard_after_forward``."""

    replicate_degree: int = 1
    """Copies of the sharded model (HSDP x TP: ``replicate x shard x tensor``); the shard
    degree is what is left of the world."""

    def __post_init__(self) -> None:
        super().__post_init__()
        # The fields' own messages.
        ParallelDegrees(tensor_degree=self.tensor_degree, replicate_degree=self.replicate_degree)
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError("reshard_after_forward must be True or False, got "
                             f"{self.reshard_after_forward!r}")

    def degrees(self, topology: Topology) -> ParallelDegrees:
        """``shard x tensor``, the shard degree filling the world."""
        if not topology.is_distributed:
            return ParallelDegrees()  # one process runs as 'single' (see notice)
        degrees = ParallelDegrees.infer(world_size=topology.world_size, pipeline_degree=1,
                                        replicate_degree=self.replicate_degree,
                                        shard_degree=None, tensor_degree=self.tensor_degree)
        if degrees.replicate_degree > 1 and degrees.shard_degree == 1:
            raise ValueError(f"replicate_degree={self.replicate_degree} x tensor_degree="
                             f"{self.tensor_degree} leaves no shard degree on "
                             f"{topology.world_size} processes; tensor parallel with "
                             "replicas needs dp_shard > 1 (HSDP x TP) or a pipeline")
        return degrees

    def sharding(self) -> FSDPOptions:
        return FSDPOptions(reshard_after_forward=self.reshard_after_forward)


def apply_tp(model: nn.Module, tp_mesh: Any, plan: dict[str, str], *,
             sequence_parallel: bool = False) -> None:
    """Split ``plan``'s linears over ``tp_mesh`` (with the residual stream sharded over the
    sequence if asked) and divide the head counts to match."""
    from torch.distributed.tensor.parallel import parallelize_module

    degree = tp_mesh.size()
    check_divisible(model, plan, degree)
    if sequence_parallel:
        apply_sequence_parallel(model, tp_mesh, plan)
    else:
        modules = dict(model.named_modules())
        parallelize_module(model, tp_mesh, {name: parallel_style(modules[name], style)
                                            for name, style in plan.items()})
    shard_heads(model, plan, degree)


def parallelize(module: nn.Module, mesh: ParallelMesh, *, plan: dict[str, str] | None,
                sharding: FSDPOptions, mp_policy: Any, sequence_parallel: bool = False,
                output_layer: str | None = None) -> bool:
    """The one composition of a model (or a pipeline stage) over ``mesh``'s degrees.

    In torchtitan's order: tensor parallel over the ``tensor`` axis (with sequence
    parallel, then loss parallel on ``output_layer``), then FSDP2 over the data axes
    (``shard``, or ``replicate x shard``: HSDP). Returns whether loss parallel was
    applied (the caller holds torch's ``loss_parallel()`` context while it trains).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    d = mesh.degrees
    if d.tensor_degree > 1:
        tp_mesh = mesh.submesh("tensor")
        # Loss parallel owns the output layer (transformers' plans gather its output).
        plan = {name: style for name, style in (plan or {}).items() if name != output_layer}
        apply_tp(module, tp_mesh, plan, sequence_parallel=sequence_parallel)
        if output_layer is not None:
            apply_loss_parallel(module, tp_mesh, output_layer)
    if d.shard_degree > 1:
        data_axes = ("replicate", "shard") if d.replicate_degree > 1 else ("shard",)
        shard_units(module, wrap_predicate(sharding.wrap_policy, module),
                    mesh=mesh.submesh(*data_axes),
                    reshard_after_forward=sharding.reshard_after_forward,
                    mp_policy=mp_policy or MixedPrecisionPolicy())
    return d.tensor_degree > 1 and output_layer is not None


def complete_gradients(params: Iterable[nn.Parameter]) -> None:
    """Sum pending (``Partial``) DTensor gradients over their mesh, once, in place.

    The sequence-parallel norms' gradients come out of backward as per-rank partial sums;
    left so, every optimizer op and norm that reads them would all-reduce them again.
    """
    from torch.distributed.tensor import Replicate

    for p in params:
        placements = getattr(p.grad, "placements", ())
        if any(x.is_partial() for x in placements):
            whole_sum = tuple(Replicate() if x.is_partial() else x for x in placements)
            p.grad = p.grad.redistribute(p.grad.device_mesh, whole_sum)


class TPStrategy(DTensorParameters, Strategy, ShardedState, LockstepEvaluation,
                 PrecisionPolicy):
    """Tensor parallel over every rank (``tp``); :class:`FSDPTPStrategy` adds FSDP."""

    name = "tp"
    Options = TPOptions

    def __init__(self, topology: Topology, options: Any = None, *,
                 timeout_s: float = 300.0) -> None:
        super().__init__(topology, options, timeout_s=timeout_s)
        self.mesh = ParallelMesh(self.options.degrees(topology), topology)
        self.active = topology.is_distributed
        self._mp_policy: Any = None
        # Holds torch's loss_parallel() from setup_model to teardown (loss_parallel=True).
        self._loss_context = contextlib.ExitStack()
        self._names: dict[int, str] = {}
        self._params: dict[str, nn.Parameter] = {}

    def notice(self) -> str | None:
        if self.active:
            return None
        return f"strategy {self.name!r} in one process: nothing to split, running as 'single'"

    # -- layout -------------------------------------------------------------------
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

    def configure_precision(self, precision: Any) -> None:
        self._mp_policy = mixed_precision_policy(precision, refuse_fp16="with tensor parallel")

    # -- model and optimizer --------------------------------------------------------
    def setup_model(self, model: nn.Module) -> nn.Module:
        model = model.to(self.topology.device)
        names = parameter_names(model)
        plan = resolve_plan(model, self.options.plan)  # a bad plan fails in every process
        if self.options.sequence_parallel:
            block_container(model, plan)
        output_layer = (find_output_layer(model, self.options.output_layer)
                        if self.options.loss_parallel else None)
        if self.active and parallelize(
                model, self.mesh, plan=plan, sharding=self.options.sharding(),
                mp_policy=self._mp_policy, sequence_parallel=self.options.sequence_parallel,
                output_layer=output_layer):
            self._loss_context.enter_context(loss_parallel_context())
        self._remember(model, names)
        return model

    def evaluation_batches(self, batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        if self.data_parallel_size == 1:
            # Every rank reads the same batches: they run the same forwards already.
            yield from ((batch, True) for batch in batches)
            return
        yield from super().evaluation_batches(batches)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        if self.data_parallel_size == 1:
            # Tensor-parallel all-reduces carry activations, not gradients: they never wait.
            return contextlib.nullcontext()
        return super().no_sync(model)

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.options.sequence_parallel:
            complete_gradients(p for group in optimizer.param_groups for p in group["params"])
        optimizer.step()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        if self.options.sequence_parallel:
            complete_gradients(model.parameters())
        return super().clip_grad_norm(model, max_norm)

    def teardown(self) -> None:
        self._loss_context.close()
        super().teardown()


class FSDPTPStrategy(TPStrategy):
    """``shard x tensor``: tensor parallel inside groups of ``tensor_degree`` ranks,
    FSDP across the groups (which read different data)."""

    name = "fsdp_tp"
    Options = FSDPTPOptions

    def notice(self) -> str | None:
        if not self.active:
            return super().notice()
        d = self.mesh.degrees
        replicas = f"replicate {d.replicate_degree} x " if d.replicate_degree > 1 else ""
        return (f"strategy 'fsdp_tp': {replicas}shard {d.shard_degree} x tensor "
                f"{d.tensor_degree}")
