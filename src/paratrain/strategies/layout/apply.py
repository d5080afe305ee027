"""The one function that applies a layout's parallelisms to a model, in one order.

:func:`parallelize` takes a model (or this rank's pipeline stage: the pipeline split
comes first, in :mod:`.stages`) and the mesh, and applies, each step a small function
over the slice of the mesh it needs:

1. tensor parallel over ``tensor`` (+ sequence parallel, + loss parallel);
2. context parallel over ``context`` (attention over the whole sequence, positions);
3. expert parallel over the expert mesh (each rank keeps ``E / ep`` experts);
4. activation checkpointing;
5. compile (per FSDP unit, so FSDP's hooks run around each compiled block);
6. FSDP over the data axes: ``shard x context`` (HSDP with ``replicate``; shard 1 when
   there are only replicas, so replicas average gradients the same way everywhere).
   Experts are their own units, sharded over the ranks that hold the same experts.
   With ``semi_sync`` (LocalSGD, DiLoCo) the replicas stay apart: FSDP shards within a
   replica group only (none when ``shard x context`` is 1), and the outer sync
   (:mod:`paratrain.strategies.semisync`) runs after the optimizer step instead.

This is torchtitan's order (a model's ``parallelize.py``): TP before FSDP so that FSDP
shards the TP pieces once more; activation checkpointing and compile wrap blocks whose
parameters are already placed; FSDP last, root last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from paratrain.activation_checkpointing import apply_activation_checkpointing
from paratrain.compile import CompileOptions, compile_forward, compile_model
from paratrain.distributed.mesh import ParallelMesh
from paratrain.parallel.degrees import Parallel
from paratrain.parallel.options import ContextParallel, Sharding
from paratrain.strategies.dtensor_params import shard_units
from paratrain.strategies.fsdp import wrap_predicate
from paratrain.strategies.tensor.apply import apply_tensor_parallel

__all__ = ["Applied", "parallelize"]


@dataclass
class Applied:
    """What :func:`parallelize` did that the step needs later."""

    loss_parallel: bool = False
    """The output layer's logits stay vocabulary-sharded (hold ``loss_parallel()``)."""

    context: Any = None
    """The context-parallel runner (slices batches, scales losses, ends the step)."""

    expert_layers: int = 0
    """Mixture-of-experts layers split over the expert group."""

    sharded: bool = False
    """FSDP placed the parameters (gradients are reduced by it)."""


def parallelize(module: nn.Module, mesh: ParallelMesh, layout: Parallel, *,
                plan: dict[str, str] | None, output_layer: str | None = None,
                mp_policy: Any = None, checkpoint_activations: Any = None,
                compile_options: CompileOptions | None = None,
                offload_policy: Any = None) -> Applied:
    """Apply every parallelism of ``layout`` to ``module`` over ``mesh``, in the one order.

    Args:
        module: the model, or this rank's pipeline stage.
        mesh: the layout's mesh (built once, by the strategy).
        layout: the degrees' options (``tensor``, ``sharding``, ``context``).
        plan: the tensor-parallel plan (``resolve_plan``), with ``tp`` > 1.
        output_layer: the layer loss parallel splits, or None.
        mp_policy: FSDP's mixed-precision policy, or None.
        checkpoint_activations: what to recompute in backward (``RunConfig``'s spec).
        compile_options: compile each block (each unit with FSDP), or None.
        offload_policy: FSDP's offload policy, or None.
    """
    d = mesh.degrees
    applied = Applied()
    if d.tensor_degree > 1:
        tensor = layout.tensor
        applied.loss_parallel = apply_tensor_parallel(
            module, mesh.submesh("tensor"), plan or {},
            sequence_parallel=bool(tensor and tensor.sequence_parallel),
            output_layer=output_layer)
    if d.context_degree > 1:
        applied.context = apply_context(module, mesh, layout.context or ContextParallel())
    if d.expert_degree > 1:
        applied.expert_layers = apply_experts(module, mesh)
    if checkpoint_activations is not None:
        apply_activation_checkpointing(module, checkpoint_activations)
    # Semi-synchronous replicas never average gradients: FSDP stays inside a group.
    replicas = layout.semi_sync is None
    sharded = (d.data_parallel_degree if replicas else d.shard_degree) * d.context_degree > 1
    if not sharded:
        if compile_options is not None:
            compile_model(module, compile_options)
        return applied
    apply_fsdp(module, mesh, layout.sharding or Sharding(), mp_policy=mp_policy,
               compile_options=compile_options, offload_policy=offload_policy,
               replicas=replicas)
    applied.sharded = True
    return applied


def apply_context(module: nn.Module, mesh: ParallelMesh, options: ContextParallel) -> Any:
    """Route ``module``'s attention over the ``context`` group; the runner the step uses."""
    from paratrain.strategies.context.apply import ContextParallel as ContextRunner

    runner = ContextRunner(mesh.group("context"), method=options.method,
                           load_balanced=options.load_balanced)
    runner.attach(module)
    return runner


def apply_experts(module: nn.Module, mesh: ParallelMesh) -> int:
    """Keep this rank's share of every MoE layer's experts (paratrain's ``MoE`` and the
    stacked experts of Hugging Face MoE families); one line if the model has none."""
    from paratrain.strategies.experts.apply import apply_expert_parallel
    from paratrain.strategies.experts.stacked import dispatch_stacked_experts

    experts = mesh.expert_mesh["expert"]
    group = experts.get_group()
    layers = apply_expert_parallel(module, group, balance_group=mesh.loss_group, mesh=experts)
    layers += dispatch_stacked_experts(module, group, mesh=experts)
    if not layers:
        raise ValueError(f"ep={mesh.degrees.expert_degree} but the model has no "
                         "mixture-of-experts layer paratrain can split (paratrain.models MoE, "
                         "or the stacked experts of Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE); "
                         "drop ep")
    return layers


def expert_modules(module: nn.Module) -> list[nn.Module]:
    """The modules that hold split experts (each its own FSDP unit)."""
    from paratrain.strategies.experts.moe import StackedExperts
    from paratrain.strategies.experts.stacked import DispatchedExperts

    return [m for m in module.modules() if isinstance(m, (StackedExperts, DispatchedExperts))
            and getattr(m, "group", None) is not None]


def apply_fsdp(module: nn.Module, mesh: ParallelMesh, sharding: Sharding, *, mp_policy: Any,
               compile_options: CompileOptions | None, offload_policy: Any,
               replicas: bool = True) -> None:
    """FSDP2 over the data axes: split experts first (over the ranks holding the same
    experts), then the blocks the wrap policy names, then the root. ``replicas``: False
    shards within a replica group only (its mesh leaves ``replicate`` out)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy, fully_shard

    kwargs = {"reshard_after_forward": sharding.reshard_after_forward,
              "mp_policy": mp_policy or MixedPrecisionPolicy(),
              "offload_policy": offload_policy or OffloadPolicy()}
    d = mesh.degrees
    experts = expert_modules(module)
    if experts:
        axes = ("replicate", "expert_shard") if d.replicate_degree > 1 else ("expert_shard",)
        expert_mesh = mesh.expert_mesh[axes if len(axes) > 1 else axes[0]]
        for unit in experts:
            # An expert's gradient already sums every rank's tokens of its expert group
            # (the all-to-all's backward): averaged over the ranks that share this expert
            # and divided by ep, it is the average over all the loss ranks, as the dense
            # gradients are.
            unit.grad_scale = 1.0 / d.expert_degree
            fully_shard(unit, mesh=expert_mesh, **kwargs)
    inner = set(map(id, experts))
    wrap = wrap_predicate(sharding.wrap_policy, module)
    shard_units(module, lambda m: id(m) not in inner and wrap(m),
                # Per block, before sharding (as torchtitan does): the block's graph stays
                # whole, FSDP's hooks run around it.
                before_shard=None if compile_options is None
                else lambda unit: compile_forward(unit, compile_options),
                mesh=mesh.fsdp_mesh(replicate=replicas), **kwargs)
