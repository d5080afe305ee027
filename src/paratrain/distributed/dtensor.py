"""Plain tensors out of DTensors, for code that must not care how a value is laid out."""

from __future__ import annotations

import math
from typing import Any

import torch

from paratrain.distributed._compat import all_gather_single, flattened_group, shard_indices

__all__ = ["local_piece", "whole"]


def whole(value: Any) -> Any:
    """``value`` as a plain tensor: a DTensor (a sharded norm, vocabulary-sharded logits
    or a loss computed from them) is gathered whole; anything else is returned as is.

    Example:
        >>> import torch
        >>> whole(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    full_tensor = getattr(value, "full_tensor", None)
    if full_tensor is None:
        return value
    sharded = [d for d, p in enumerate(value.placements)
               if not (p.is_replicate() or p.is_partial())]
    if len(sharded) < 2 or value.requires_grad or any(p.is_partial() for p in value.placements):
        return full_tensor()
    return _gather_in_one_step(value, sharded)


def _gather_in_one_step(value: Any, sharded: list[int]) -> torch.Tensor:
    """A DTensor sharded over several mesh dimensions, gathered by ONE all_gather.

    ``full_tensor`` would gather one mesh dimension after another, and cannot merge
    them for FSDP over tensor-parallel pieces (``_StridedShard`` then ``Shard`` on
    the same dimension: the pieces' order is not the mesh's), so DTensor warns on every
    rank about "sequential all_gather operations". Here every rank sends its piece
    over the flattened mesh of the sharded dimensions, and each piece is written at
    the indices DTensor's own arithmetic gives for its sender's coordinate.
    """
    mesh = value.device_mesh
    names = mesh.mesh_dim_names
    submesh = mesh[tuple(names[d] for d in sharded)] if names else None
    if submesh is None:
        return value.full_tensor()
    shape, placements = tuple(value.shape), value.placements
    mine = [mesh.get_local_rank(d) for d in range(mesh.ndim)]
    senders = []  # (shape, indices) of each rank of the flattened mesh, in its order
    for flat in range(math.prod(mesh.shape[d] for d in sharded)):
        coordinate = list(mine)
        for d in reversed(sharded):
            flat, coordinate[d] = divmod(flat, mesh.shape[d])
        indices = shard_indices(shape, mesh.shape, coordinate, placements)
        senders.append(([len(i) for i in indices], indices))
    width = max(math.prod(s) for s, _ in senders)
    local = value.to_local().detach().contiguous().flatten()
    padded = torch.zeros(width, dtype=local.dtype, device=local.device)
    padded[:local.numel()] = local
    gathered = torch.empty(width * len(senders), dtype=local.dtype, device=local.device)
    all_gather_single(gathered, padded, flattened_group(submesh))
    out = torch.empty(shape, dtype=local.dtype, device=local.device)
    for rank, (sizes, indices) in enumerate(senders):
        piece = gathered[rank * width: rank * width + math.prod(sizes)].view(sizes)
        grid = [i.to(out.device).view([-1 if k == d else 1 for k in range(len(shape))])
                for d, i in enumerate(indices)]
        out.index_put_(grid, piece)
    return out


def local_piece(value: Any) -> Any:
    """A DTensor's local piece (a view that writes through), or ``value`` itself."""
    to_local = getattr(value, "to_local", None)
    return to_local() if to_local is not None else value
