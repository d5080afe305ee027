"""Exact attention over a sequence split across the context-parallel ranks.

Two ways, both through ``torch.distributed`` and both differentiable (autograd runs the
communication backwards), both exact: the result is softmax attention over the whole
sequence, up to the order of float sums.

* **Ring** (:func:`ring_attention`): queries stay; keys and values travel around the
  ring of cp ranks, one neighbour shift per step (``cp - 1`` shifts forward; backward,
  K/V go round again with their gradients, ``2 cp - 1`` shifts). Each step folds the
  visiting block's scores into a running output and log-sum-exp (online softmax) and
  drops them; only the local q, k, v, output and log-sum-exp are kept for backward, so
  a rank holds ``1/cp`` of one process's attention memory, as a flash kernel would. Query/key
  chunk pairs that the causal mask hides entirely are skipped: with the load-balanced
  order (:mod:`.sequence`) every rank scores the same number of pairs.
* **All-to-all** (:func:`all_to_all_attention`, the Ulysses scheme): one all-to-all
  trades the sequence split for a head split, each rank attends over the whole sequence
  for ``heads / cp`` heads with torch's own ``scaled_dot_product_attention``, and a
  second all-to-all trades back. Needs ``heads`` divisible by cp; two collectives per
  layer instead of ``cp - 1`` shifts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.strategies.context.sequence import SequenceOrder

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _start_shift(tensor: torch.Tensor, group: Any, step: int) -> Callable[[], torch.Tensor]:
    """Start sending ``tensor`` ``step`` ranks ahead on the ring and receiving from ``step``
    behind; the returned function waits and gives what arrived. Started before a block's
    compute and waited for after it, the transfer overlaps the compute."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    tensor = tensor.contiguous()
    received = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + step) % size),
                      group),
           dist.P2POp(dist.irecv, received, dist.get_global_rank(group, (rank - step) % size),
                      group)]
    requests = dist.batch_isend_irecv(ops)

    def wait() -> torch.Tensor:
        for request in requests:
            request.wait()
        return received

    return wait


def _shift(tensor: torch.Tensor, group: Any, step: int) -> torch.Tensor:
    """Send ``tensor`` ``step`` ranks ahead on the ring, receive from ``step`` behind."""
    return _start_shift(tensor, group, step)()


def _split(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> list[torch.Tensor]:
    return list(tensor.split([stop - start for start, stop in ranges], dim=-2))


def _repeat_kv(query: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves ``heads / kv_heads`` queries."""
    groups = query.shape[-3] // tensor.shape[-3]
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=-3)


def _scores(q: torch.Tensor, k: torch.Tensor, q_range: tuple[int, int],
            k_range: tuple[int, int], causal: bool) -> torch.Tensor | None:
    """Scores of a (pre-scaled) query chunk against a key chunk, the causal mask applied;
    None when the mask hides the whole block."""
    (q_start, q_stop), (k_start, k_stop) = q_range, k_range
    if causal and k_start >= q_stop:
        return None
    block = q @ k.transpose(-1, -2)
    if causal and k_stop - 1 > q_start:
        hidden = (torch.arange(k_start, k_stop, device=q.device)[None, :]
                  > torch.arange(q_start, q_stop, device=q.device)[:, None])
        block = block.masked_fill(hidden, float("-inf"))
    return block


def _finite(lse: torch.Tensor) -> torch.Tensor:
    # A row no visible key has reached yet keeps -inf; it must scale by 0, not NaN.
    return torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)


class _RingAttention(torch.autograd.Function):
    """Ring attention that saves only its inputs, output and log-sum-exp (flash-style).

    Forward: for each visiting K/V block, the local queries' scores are computed, folded
    into the running output and log-sum-exp (online softmax), and dropped. Backward: K/V
    go round the ring again, each block's probabilities are recomputed from the saved
    log-sum-exp, and the block's dK/dV travel with it, one hop more, back to its owner.
    """

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                group: Any, order: SequenceOrder, causal: bool, scale: float) -> torch.Tensor:
        rank = dist.get_rank(group)
        q_ranges = order.chunk_ranges(rank)
        q_chunks = _split(query * scale, q_ranges)
        outs = [torch.zeros_like(q) for q in q_chunks]
        lses = [q.new_full((*q.shape[:-1], 1), float("-inf")) for q in q_chunks]
        kv = torch.stack((key, value))
        arriving = None
        for step in range(order.cp):
            if arriving is not None:
                kv = arriving()
            # The next block's K/V travel while this one is computed.
            arriving = _start_shift(kv, group, 1) if step + 1 < order.cp else None
            k_ranges = order.chunk_ranges((rank - step) % order.cp)
            for i, (q_range, q) in enumerate(zip(q_ranges, q_chunks)):
                for k_range, k, v in zip(k_ranges, _split(kv[0], k_ranges),
                                         _split(kv[1], k_ranges)):
                    block = _scores(q, k, q_range, k_range, causal)
                    if block is None:
                        continue
                    lse = torch.logaddexp(lses[i], torch.logsumexp(block, -1, keepdim=True))
                    safe = _finite(lse)
                    outs[i] = outs[i] * torch.exp(lses[i] - safe) + torch.exp(block - safe) @ v
                    lses[i] = lse
        out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-2)
        # Laid out (..., length, heads, dim) in memory, as torch's flash kernel returns it:
        # the model's transpose + reshape back to (..., length, width) is then a view, and
        # the output projection saves this same storage instead of a copy.
        out = out.transpose(-2, -3).contiguous().transpose(-2, -3)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.order, ctx.causal, ctx.scale = group, order, causal, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        query, key, value, out, lse = ctx.saved_tensors
        group, order, causal, scale = ctx.group, ctx.order, ctx.causal, ctx.scale
        rank = dist.get_rank(group)
        q_ranges = order.chunk_ranges(rank)
        q_chunks = _split(query * scale, q_ranges)
        d_outs = _split(grad_out.contiguous(), q_ranges)
        lses = [_finite(x) for x in _split(lse, q_ranges)]
        # D = rowsum(dO * O): the softmax backward's correction term.
        corrections = [(d * o).sum(-1, keepdim=True)
                       for d, o in zip(d_outs, _split(out, q_ranges))]
        d_queries = [torch.zeros_like(q) for q in q_chunks]
        kv = torch.stack((key, value))
        d_kv = torch.zeros_like(kv)
        arriving = None
        for step in range(order.cp):
            if step:
                # K/V were sent ahead during the last block; their gradients only now.
                kv, d_kv = arriving(), _shift(d_kv, group, 1)
            arriving = _start_shift(kv, group, 1) if step + 1 < order.cp else None
            k_ranges = order.chunk_ranges((rank - step) % order.cp)
            blocks = zip(k_ranges, _split(kv[0], k_ranges), _split(kv[1], k_ranges),
                         _split(d_kv[0], k_ranges), _split(d_kv[1], k_ranges))
            for k_range, k, v, d_k, d_v in blocks:
                for i, (q_range, q) in enumerate(zip(q_ranges, q_chunks)):
                    block = _scores(q, k, q_range, k_range, causal)
                    if block is None:
                        continue
                    probs = torch.exp(block - lses[i])
                    d_v += probs.transpose(-1, -2) @ d_outs[i]
                    d_scores = probs * (d_outs[i] @ v.transpose(-1, -2) - corrections[i])
                    d_queries[i] += d_scores @ k
                    d_k += d_scores.transpose(-1, -2) @ q
        if order.cp > 1:
            d_kv = _shift(d_kv, group, 1)  # the last hop: each block's gradient home
        d_query = torch.cat(d_queries, dim=-2) * scale
        return d_query, d_kv[0], d_kv[1], None, None, None, None


def ring_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                   group: Any, order: SequenceOrder, causal: bool,
                   scale: float | None = None) -> torch.Tensor:
    """Attention of the local queries over the whole sequence, K/V passed round the ring.

    Saves for backward only the local q, k, v, output and log-sum-exp: a rank's attention
    memory is ``1/cp`` of one process's, as with a flash kernel.

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
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    dtype = query.dtype
    compute = torch.float32 if dtype in _LOW_PRECISION else dtype
    key, value = _repeat_kv(query, key), _repeat_kv(query, value)
    out = _RingAttention.apply(query.to(compute), key.to(compute), value.to(compute), group,
                               order, causal, scale)
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
