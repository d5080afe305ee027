"""Alpha-beta cost of the collectives behind each strategy (formulas in ``docs/plan.md``).

``time = latency terms + bytes / bandwidth``, ring algorithms within a level, and a
two-level (intra-node, inter-node) hierarchy for clusters of several nodes.
"""

from __future__ import annotations

import math

from paratrain.plan.types import Hardware

#: PyTorch DDP's default bucket size (``bucket_cap_mb=25``).
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
#: ... and the smaller first bucket it uses so communication starts early.
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


def ring_allreduce_time(size_bytes: float, num_ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: ``2(N-1)/N * S/B + 2(N-1) * alpha`` (0 for one rank)."""
    n = num_ranks
    return 0.0 if n <= 1 else 2 * (n - 1) / n * size_bytes / bandwidth + 2 * (n - 1) * latency


def ring_allgather_time(size_bytes: float, num_ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather of a result of ``S`` bytes: ``(N-1)/N * S/B + (N-1) * alpha``."""
    n = num_ranks
    return 0.0 if n <= 1 else (n - 1) / n * size_bytes / bandwidth + (n - 1) * latency


def ring_reduce_scatter_time(
    size_bytes: float, num_ranks: int, bandwidth: float, latency: float
) -> float:
    """Ring reduce-scatter of an ``S``-byte input: same cost as the all-gather."""
    return ring_allgather_time(size_bytes, num_ranks, bandwidth, latency)


def _links(hw: Hardware) -> tuple[int, int, float, float, float, float]:
    return (hw.num_devices_per_node, hw.num_nodes, hw.intra_node_bandwidth,
            hw.intra_node_latency, hw.inter_node_bandwidth, hw.inter_node_latency)


def allreduce_time(size_bytes: float, hw: Hardware) -> float:
    """Hierarchical all-reduce: intra reduce-scatter, inter all-reduce of S/n, intra all-gather.

    With one node the inter-node term is 0 and this is exactly the ring formula.
    """
    n, k, bi, ai, be, ae = _links(hw)
    return (ring_reduce_scatter_time(size_bytes, n, bi, ai)
            + ring_allreduce_time(size_bytes / n, k, be, ae)
            + ring_allgather_time(size_bytes, n, bi, ai))


def allgather_time(size_bytes: float, hw: Hardware) -> float:
    """Hierarchical all-gather: inter-node all-gather of S/n, then intra-node of S."""
    n, k, bi, ai, be, ae = _links(hw)
    return ring_allgather_time(size_bytes / n, k, be, ae) + ring_allgather_time(size_bytes, n, bi, ai)


def reduce_scatter_time(size_bytes: float, hw: Hardware) -> float:
    """Hierarchical reduce-scatter: intra-node of S, then inter-node of S/n (mirror of all-gather)."""
    return allgather_time(size_bytes, hw)


def allreduce_bytes(size_bytes: float, hw: Hardware) -> float:
    """Bytes each device sends in :func:`allreduce_time`."""
    n, k = hw.num_devices_per_node, hw.num_nodes
    return 2 * (n - 1) / n * size_bytes + 2 * (k - 1) / k * size_bytes / n


def allgather_bytes(size_bytes: float, hw: Hardware) -> float:
    """Bytes each device sends in :func:`allgather_time` (or a reduce-scatter)."""
    n, k = hw.num_devices_per_node, hw.num_nodes
    return (n - 1) / n * size_bytes + (k - 1) / k * size_bytes / n


def ps_comm_time(
    push_bytes: float, pull_bytes: float, *, num_workers: int, num_servers: int,
    bandwidth: float, latency: float,
) -> float:
    """Synchronous parameter server: a pull phase and a push phase on shared links.

    When a round closes, each of the ``k`` servers sends its shard to all ``W`` workers
    at once, so the transfers share its link: ``W * pull / k`` bytes leave it while each
    worker receives ``pull``. The workers then restart together, compute, and push
    together: ``W * push / k`` bytes reach each server. The slower end of each phase
    sets its time: ``max(W / k, 1) * (push + pull) / B + 2 * alpha``.
    """
    fan = max(num_workers / num_servers, 1.0)
    return fan * (push_bytes + pull_bytes) / bandwidth + 2 * latency


def exposed_comm_time(comm: float, window: float, *, overlap: float = 1.0, tail: float = 0.0) -> float:
    """Communication left on the critical path after hiding it behind ``window`` of compute.

    ``tail`` is the part that cannot overlap (e.g. DDP's last bucket, ready only when
    backward ends); the rest hides behind ``overlap * window``.
    """
    tail = min(tail, comm)
    return tail + max(0.0, comm - tail - overlap * window)


def ddp_buckets(grad_bytes: float, num_layers: int, bucket_bytes: float = DEFAULT_BUCKET_BYTES,
                first_bucket_bytes: float = DEFAULT_FIRST_BUCKET_BYTES) -> list[float]:
    """Sizes of DDP's gradient buckets, in the order backward fills them.

    Gradients arrive in equal chunks (one per layer, split further so no chunk exceeds a
    bucket), last layer first; as in DDP a bucket closes once it holds at least its cap,
    1 MiB for the first bucket and ``bucket_bytes`` for the others.
    """
    chunks = num_layers * math.ceil(grad_bytes / num_layers / bucket_bytes)
    c = grad_bytes / chunks
    first = min(chunks, math.ceil(first_bucket_bytes / c))
    per = math.ceil(bucket_bytes / c)
    full, rest = divmod(chunks - first, per)
    return [first * c] + [per * c] * full + ([rest * c] if rest else [])
