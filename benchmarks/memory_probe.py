"""What the memory benchmarks measure on each rank: bytes held in local tensors, peak RSS.

Shared by ``sharding_memory.py``, ``zero_memory.py`` and ``tp_layouts.py`` so that their
columns are counted the same way.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from paratrain.distributed.dtensor import local_piece


def local_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of this rank's part of ``tensors`` (a DTensor counts its local shard).

    ``None`` and scalars (an optimizer's step counter) are skipped.
    """
    total = 0
    for t in tensors:
        if t is None or not hasattr(t, "dim") or t.dim() == 0:
            continue
        local = local_piece(t)
        total += local.numel() * local.element_size()
    return total


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of the optimizer state this rank holds (moments, not step counters)."""
    return local_bytes(v for s in optimizer.state.values() for v in s.values())


@contextlib.contextmanager
def saved_activations(parameters: Iterable[Any]) -> Iterator[list[int]]:
    """Count the bytes autograd saves for backward inside the block (activations, this
    rank's part of them; each storage once, parameters excluded). Yields a one-item list
    that holds the total when the block ends."""
    skip = {local.untyped_storage().data_ptr() for local in
            (local_piece(p) for p in parameters)}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        local = local_piece(tensor)
        storage = local.untyped_storage()
        if storage.data_ptr() not in skip:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    total = [0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield total
    total[0] = sum(seen.values())


def max_rss() -> int:
    """Peak resident memory of this process so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def mlp(width: int, depth: int) -> nn.Sequential:
    """``depth`` square Linear+ReLU layers and a 10-way head: sharded evenly by any strategy."""
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))
