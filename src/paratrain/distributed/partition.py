"""Splitting a chain of layers into balanced stages (pure arithmetic, no torch).

Shared by the pipeline strategies, which cut an ``nn.Sequential`` into stages, and by
the planner, which predicts what crosses the cuts.
"""

from __future__ import annotations


def balanced_split(sizes: list[int], num_stages: int) -> list[int]:
    """Start indices of stages 1.. that minimise the largest stage's total size.

    Every stage gets at least one layer. Exact (dynamic programming over prefixes).
    """
    n = len(sizes)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} stages; "
                         "use fewer processes or a model with more children")
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)
    inf = float("inf")
    # best[k][i]: smallest possible largest-stage size for the first i layers in k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], n
    for k in range(num_stages, 1, -1):
        i = cut[k][i]
        starts.append(i)
    return starts[::-1]
