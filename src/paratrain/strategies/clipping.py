"""Global-norm gradient clipping over any layout: the one owner.

The norm is the whole model's, wherever each gradient lies: plain tensors (one process,
``ddp``, ``zero1``, ``ps``), DTensor shards on any mesh (``fsdp``, ``zero2``, ``tp``,
their 2-D layouts, split pipeline stages), and a pipeline's stages, whose squares are
summed over the pipeline group. Every strategy's ``clip_grad_norm`` comes here, so a new
parallel dimension gets clipping by putting its gradients on a mesh (or naming the group
its parts are spread over), not by writing a sixth norm.

For plain gradients only, the norm and the scaling are torch's ``clip_grad_norm_``
arithmetic, bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["clip_grad_norm", "global_grad_norm", "scale_gradients"]


def clip_grad_norm(parameters: Iterable[nn.Parameter], max_norm: float, *,
                   across: dist.ProcessGroup | None = None,
                   device: torch.device | None = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so their global L2 norm is at most
    ``max_norm``; return that norm before clipping (a plain 0-dim tensor).

    Args:
        parameters: this rank's parameters (DTensor or plain).
        max_norm: the bound.
        across: a group whose ranks hold other parts of the model (a pipeline's stages):
            the squares are summed over it, in float64.
        device: where a cross-group reduction runs (the process's device).

    Example:
        >>> norm = clip_grad_norm(model.parameters(), 1.0)          # doctest: +SKIP
    """
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(params)
    if across is not None:
        squares = norm.to(device or norm.device, torch.float64) ** 2
        dist.all_reduce(squares, group=across)
        norm = squares.sqrt().float()
    scale_gradients(params, norm, max_norm)
    return norm


def global_grad_norm(parameters: Iterable[nn.Parameter]) -> torch.Tensor:
    """The L2 norm of all gradients, whole, whatever mesh each DTensor gradient lies on.

    Gradients are grouped by mesh and placement so that each group's squares are reduced
    once, not once per parameter.
    """
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in parameters:
        if p.grad is not None:
            key = (getattr(p.grad, "device_mesh", None), getattr(p.grad, "placements", None))
            groups.setdefault(key, []).append(p.grad)
    if not groups:
        return torch.zeros(())
    if len(groups) == 1 and None in next(iter(groups)):
        # Plain gradients only: torch's norm as is (no square and root, which could
        # change the last bit).
        return nn.utils.get_total_norm(next(iter(groups.values())))
    squares = [_sum_of_squares(grads, mesh, placements)
               for (mesh, placements), grads in groups.items()]
    return torch.stack(squares).sum().sqrt()


def _sum_of_squares(grads: list[torch.Tensor], mesh: Any, placements: Any) -> torch.Tensor:
    # Local sums, then one all-reduce per sharded mesh dimension: what DTensor's norm does,
    # without its advice (a warning on every rank) to flatten a 2-D mesh for one scalar.
    if mesh is None:
        return nn.utils.get_total_norm(grads) ** 2
    if any(p.is_partial() for p in placements):
        raise RuntimeError("gradients with pending sums (Partial); call complete_gradients "
                           "before taking their norm")
    local = nn.utils.get_total_norm([g.to_local() for g in grads]) ** 2
    for dim, placement in enumerate(placements):
        # What is not replicated is sharded (FSDP over TP shards dim 0 "strided", which is
        # not is_shard()).
        if not placement.is_replicate():
            dist.all_reduce(local, group=mesh.get_group(dim))
    return local


def scale_gradients(params: Iterable[nn.Parameter], norm: torch.Tensor, max_norm: float) -> None:
    """Clip ``params``' gradients to ``max_norm`` given their global ``norm``.

    A plain 0-dim coefficient scales DTensor and plain gradients alike, with no host sync.
    """
    coefficient = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.mul_(coefficient)
