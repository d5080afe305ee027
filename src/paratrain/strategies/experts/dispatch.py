"""Token dispatch to experts held by other ranks: dropless, uneven all-to-all.

Each rank routes its own tokens. With ``ep`` ranks and ``E`` experts, rank ``j`` holds
experts ``j * E/ep ... (j + 1) * E/ep - 1``. A token's copies (one per chosen expert)
are sorted by expert, the per-expert counts are exchanged (one small all-to-all), and
the copies travel with ``all_to_all_single`` under those uneven splits: no capacity
factor, no token dropped. The receiver regroups what arrived (source-major) by local
expert, runs its experts, and the results take the reverse trip. Every collective here
is differentiable: the backward is the same all-to-all with the splits swapped.

Without a group (``ep`` = 1) the same sorting and grouping run locally, so one process
and ``ep`` ranks compute every token's expert output with the same operations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


class _AllToAllSingle(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; the gradient goes back with them swapped."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any, send: list[int],
                receive: list[int]) -> torch.Tensor:
        ctx.group, ctx.send, ctx.receive = group, send, receive
        return _exchange(tensor, group, send, receive)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _exchange(grad, ctx.group, ctx.receive, ctx.send), None, None, None


def _exchange(tensor: torch.Tensor, group: Any, send: list[int],
              receive: list[int]) -> torch.Tensor:
    out = tensor.new_empty((sum(receive), *tensor.shape[1:]))
    dist.all_to_all_single(out, tensor.contiguous(), receive, send, group=group)
    return out


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


def scale_gradient(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """``tensor`` as it is, its gradient multiplied by ``factor`` (1.0: unchanged).

    An expert weight's gradient sums every token routed to it from its whole expert group
    (the all-to-all's backward); FSDP then averages it over the ranks holding the same
    experts. ``1 / ep`` here makes that the average over all the data ranks, as the dense
    weights' is (FSDP's own divide factor needs ``PREMUL_SUM``, which gloo lacks).
    """
    return tensor if factor == 1.0 else _ScaleGradient.apply(tensor, factor)


def split_expert_weight(whole: torch.Tensor, rank: int, ep: int, mesh: Any = None) -> Any:
    """Rank ``rank``'s experts of a stacked ``(E, ...)`` weight, as a new parameter.

    With ``mesh`` (the 1-D expert mesh) it is a DTensor ``Shard(0)`` of the whole weight,
    so checkpoints and whole-state gathers see the layer's ``E`` experts under one name,
    and FSDP shards it further over the ranks holding the same experts; without, a plain
    tensor (the group alone).
    """
    local = whole.shape[0] // ep
    piece = whole.detach()[rank * local:(rank + 1) * local].clone()
    if mesh is not None:
        from torch.distributed.tensor import DTensor, Shard

        piece = DTensor.from_local(piece, mesh, [Shard(0)], run_check=False)
    return torch.nn.Parameter(piece, requires_grad=whole.requires_grad)


def local_weight(weight: torch.Tensor, grad_scale: float) -> torch.Tensor:
    """This rank's experts of ``weight`` as a plain tensor (a DTensor's local piece), its
    gradient scaled by ``grad_scale`` (see :func:`scale_gradient`)."""
    local = weight.to_local() if hasattr(weight, "to_local") else weight
    return scale_gradient(local, grad_scale)


def _by_expert(counts: torch.Tensor) -> torch.Tensor:
    """Index that reorders rows laid out source-major (``counts[source, expert]`` rows
    each) into expert-major order (each expert's rows from source 0, 1, ...)."""
    sources, experts = counts.shape
    starts = torch.cumsum(counts.flatten(), 0) - counts.flatten()
    starts = starts.view(sources, experts)
    pieces = [torch.arange(int(starts[s, e]), int(starts[s, e] + counts[s, e]))
              for e in range(experts) for s in range(sources)]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def run_experts(rows: torch.Tensor, expert_ids: torch.Tensor, num_experts: int,
                experts: Callable[[int, torch.Tensor], torch.Tensor], group: Any = None
                ) -> torch.Tensor:
    """Each row through its expert, wherever that expert lives.

    Args:
        rows: ``(n, d)`` token copies, sorted by ``expert_ids``.
        expert_ids: ``(n,)`` the expert of each row, ascending.
        num_experts: experts in the whole layer (all ranks).
        experts: ``(local_expert_index, rows) -> outputs`` for this rank's experts.
        group: the expert-parallel group; None runs every expert here.

    Returns:
        ``(n, d)`` the expert outputs, in the order of ``rows``.
    """
    counts = torch.bincount(expert_ids, minlength=num_experts)
    ep = 1 if group is None else dist.get_world_size(group)
    local = num_experts // ep
    if group is None:
        arrived, by_source = rows, counts.view(1, local)
    else:
        by_destination = counts.view(ep, local)
        # How many rows each source sends for each of my experts: one small exchange.
        by_source = torch.empty_like(by_destination)
        dist.all_to_all_single(by_source, by_destination.contiguous(), group=group)
        send = by_destination.sum(1).tolist()
        receive = by_source.sum(1).tolist()
        arrived = _AllToAllSingle.apply(rows, group, send, receive)
    regroup = _by_expert(by_source).to(rows.device)
    grouped = arrived.index_select(0, regroup)
    sizes = by_source.sum(0).tolist()
    outputs = [experts(e, chunk) for e, chunk in enumerate(grouped.split(sizes))]
    done = torch.cat(outputs) if outputs else grouped
    restored = done.index_select(0, torch.argsort(regroup))
    if group is None:
        return restored
    return _AllToAllSingle.apply(restored, group, receive, send)
