"""Exact attention over a sequence split across the context-parallel ranks.

Two ways, both through ``torch.distributed`` and both differentiable (autograd runs the
communication backwards), both exact: the result is softmax attention over the whole
sequence, up to the order of float sums.

* **Ring** (:func:`ring_attention`): queries stay; keys and values travel around the
  ring of cp ranks, one neighbour shift per step (``cp - 1`` shifts forward, as many
  backward). Each step scores the local queries against the visiting block; the softmax
  is taken over all blocks at the end (log-sum-exp), so no rank ever holds the whole
  sequence's keys, and a rank's score memory is ``1/cp`` of one process's. Query/key
  chunk pairs that the causal mask hides entirely are skipped: with the load-balanced
  order (:mod:`.sequence`) every rank scores the same number of pairs.
* **All-to-all** (:func:`all_to_all_attention`, the Ulysses scheme): one all-to-all
  trades the sequence split for a head split, each rank attends over the whole sequence
  for ``heads / cp`` heads with torch's own ``scaled_dot_product_attention``, and a
  second all-to-all trades back. Needs ``heads`` divisible by cp; two collectives per
  layer instead of ``cp - 1`` shifts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.strategies.context.sequence import SequenceOrder

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class _RingShift(torch.autograd.Function):
    """Send a tensor to the next rank of the ring, receive the previous rank's; the
    gradient goes the other way."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _shift(tensor, group, 1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _shift(grad, ctx.group, -1), None


def _shift(tensor: torch.Tensor, group: Any, step: int) -> torch.Tensor:
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    tensor = tensor.contiguous()
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + step) % size),
                      group),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - step) % size),
                      group)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    return received


def _split(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    return list(tensor.split([stop - start for start, stop in ranges], dim=-2))


def _repeat_kv(query: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``heads / kv_heads`` queries."""
    groups = query.shape[-3] // tensor.shape[-3]
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=-3)


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                   group: Any, order: SequenceOrder, causal: bool,
                   scale: float | None = None) -> torch.Tensor:
    """Attention of the local queries over the whole sequence, K/V passed round the ring.

    Args:
        query, key, value: ``(..., heads, local_length, head_dim)`` this rank's part of the
            sequence, in ``order``'s local order (key/value may have fewer heads: GQA).
        group: the context-parallel process group (rank ``r`` holds ``order``'s part ``r``).
        order: how the sequence is cut (:class:`~.sequence.SequenceOrder`).
        causal: whether position ``i`` attends only to positions ``<= i``.
        scale: the score scale; ``head_dim ** -0.5`` by default, as torch's.

    Returns:
        ``(..., heads, local_length, head_dim)``, the local queries' outputs.
    """
    rank = dist.get_rank(group)
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    dtype = query.dtype
    compute = torch.float32 if dtype in _LOW_PRECISION else dtype
    query = query.to(compute)
    key, value = _repeat_kv(query, key).to(compute), _repeat_kv(query, value).to(compute)
    q_ranges = order.chunk_ranges(rank)
    q_chunks = _split(query * scale, q_ranges)
    scores: list[list[torch.Tensor]] = [[] for _ in q_chunks]
    values: list[list[torch.Tensor]] = [[] for _ in q_chunks]
    both = torch.stack((key, value))
    for step in range(order.cp):
        if step:
            both = _RingShift.apply(both, group)
        k_ranges = order.chunk_ranges((rank - step) % order.cp)
        k_chunks, v_chunks = _split(both[0], k_ranges), _split(both[1], k_ranges)
        for i, ((q_start, q_stop), q) in enumerate(zip(q_ranges, q_chunks)):
            for (k_start, k_stop), k, v in zip(k_ranges, k_chunks, v_chunks):
                if causal and k_start >= q_stop:
                    continue  # every key after every query: hidden entirely
                block = q @ k.transpose(-1, -2)
                if causal and k_stop - 1 > q_start:
                    q_pos = torch.arange(q_start, q_stop, device=block.device)
                    k_pos = torch.arange(k_start, k_stop, device=block.device)
                    block = block.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
                scores[i].append(block)
                values[i].append(v)
    outputs = []
    for blocks, vs in zip(scores, values):
        # The softmax over all visited blocks at once: log-sum-exp of the whole row.
        total = torch.logsumexp(torch.cat(blocks, dim=-1), dim=-1, keepdim=True)
        outputs.append(sum(torch.exp(b - total) @ v for b, v in zip(blocks, vs)))
    out = torch.cat(outputs, dim=-2)
    # Every rank must run every shift's backward (its neighbours wait for it), also one
    # whose causal mask hid all of the last visiting block: an exact-zero term keeps the
    # last shift in the graph on every rank.
    out = out + 0.0 * both.sum()
    return out.to(dtype)


class _AllToAll(torch.autograd.Function):
    """Split ``dim_out`` into cp pieces, send piece ``j`` to rank ``j``, and concatenate
    what arrives along ``dim_in``; the gradient takes the reverse trip."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, group: Any, scatter: int,
                gather: int) -> torch.Tensor:
        ctx.group, ctx.scatter, ctx.gather = group, scatter, gather
        return _all_to_all(tensor, group, scatter, gather)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.group, ctx.gather, ctx.scatter), None, None, None


def _all_to_all(tensor: torch.Tensor, group: Any, scatter: int, gather: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    pieces = [piece.contiguous() for piece in tensor.chunk(size, dim=scatter)]
    received = [torch.empty_like(pieces[0]) for _ in range(size)]
    dist.all_to_all(received, pieces, group=group)
    return torch.cat(received, dim=gather)


def all_to_all_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                         group: Any, order: SequenceOrder, causal: bool,
                         scale: float | None = None) -> torch.Tensor:
    """Attention over the whole sequence by trading the sequence split for a head split.

    Same arguments and result as :func:`ring_attention`; ``heads`` (after GQA's repeat)
    must be divisible by cp.
    """
    cp = order.cp
    heads = query.shape[-3]
    if heads % cp:
        raise ValueError(f"context parallel all-to-all splits the {heads} attention heads "
                         f"over cp={cp} ranks; use a cp dividing {heads} or the ring method")
    key, value = _repeat_kv(query, key), _repeat_kv(query, value)
    natural = order.natural_order().to(query.device)
    back = torch.argsort(natural)

    def gather_sequence(tensor: torch.Tensor) -> torch.Tensor:
        whole = _AllToAll.apply(tensor, group, -3, -2)  # heads/cp, sequence of all ranks
        return whole.index_select(-2, natural)

    out = F.scaled_dot_product_attention(gather_sequence(query), gather_sequence(key),
                                         gather_sequence(value), is_causal=causal, scale=scale)
    return _AllToAll.apply(out.index_select(-2, back), group, -2, -3)


METHODS = {"ring": ring_attention, "all_to_all": all_to_all_attention}
"""Context-parallel attention methods by name."""
