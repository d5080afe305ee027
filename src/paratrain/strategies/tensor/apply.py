"""Tensor parallelism applied to a model (or a pipeline stage) over the ``tensor`` axis.

:func:`apply_tensor_parallel` splits the planned linears (``parallelize_module``), with
the residual stream sharded over the sequence between them if asked (sequence parallel)
and the output layer split over the vocabulary (loss parallel); the plan comes from
:func:`~paratrain.strategies.tensor.plan.resolve_plan`. :func:`complete_gradients` sums
what sequence parallel leaves pending. The layout strategy calls both, in its one order
(:mod:`paratrain.strategies.layout.apply`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

from paratrain.strategies.tensor.plan import check_divisible, parallel_style, shard_heads
from paratrain.strategies.tensor.sequence import apply_loss_parallel, apply_sequence_parallel

__all__ = ["apply_tensor_parallel", "complete_gradients"]


def apply_tensor_parallel(model: nn.Module, tp_mesh: Any, plan: dict[str, str], *,
                          sequence_parallel: bool = False,
                          output_layer: str | None = None) -> bool:
    """Split ``plan``'s layers over ``tp_mesh``, divide the head counts to match and, with
    ``output_layer``, split it for loss parallel. Returns whether loss parallel was applied
    (the caller holds torch's ``loss_parallel()`` context while it trains)."""
    from torch.distributed.tensor.parallel import parallelize_module

    degree = tp_mesh.size()
    # Loss parallel owns the output layer (transformers' plans gather its output).
    plan = {name: style for name, style in plan.items() if name != output_layer}
    check_divisible(model, plan, degree)
    if sequence_parallel:
        apply_sequence_parallel(model, tp_mesh, plan)
    else:
        modules = dict(model.named_modules())
        parallelize_module(model, tp_mesh, {name: parallel_style(modules[name], style)
                                            for name, style in plan.items()})
    shard_heads(model, plan, degree)
    if output_layer is not None:
        apply_loss_parallel(model, tp_mesh, output_layer)
        return True
    return False


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
