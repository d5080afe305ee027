"""What the memory benchmarks measure on each rank: bytes held in local tensors, peak RSS.

Shared by ``sharding_memory.py``, ``zero_memory.py`` and ``tp_layouts.py`` so that their
columns are counted the same way.
"""

from __future__ import annotations

import resource
from collections.abc import Iterable
from typing import Any

from torch import nn


def local_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of this rank's part of ``tensors`` (a DTensor counts its local shard).

    ``None`` and scalars (an optimizer's step counter) are skipped.
    """
    total = 0
    for t in tensors:
        if t is None or not hasattr(t, "dim") or t.dim() == 0:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer state this rank holds (moments, not step counters)."""
    return local_bytes(v for s in optimizer.state.values() for v in s.values())


def max_rss() -> int:
    """Peak resident memory of this process so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def mlp(width: int, depth: int) -> nn.Sequential:
    """``depth`` square Linear+ReLU layers and a 10-way head: sharded evenly by any strategy."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))
