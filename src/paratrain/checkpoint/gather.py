"""Whole tensors on rank 0 from whatever layout holds them, one tensor at a time.

Used by :func:`paratrain.checkpoint.huggingface.save_pretrained`: rank 0 receives each
tensor once, other ranks hold nothing they then drop (rows of FSDP's shards go straight
into their place), and a tensor only another pipeline stage holds is sent point to point.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def local(value: torch.Tensor) -> torch.Tensor:
    """This rank's piece of a DTensor; any other tensor as it is."""
    return value.to_local() if hasattr(value, "to_local") else value


def listing(state: dict[str, torch.Tensor], partial: bool) -> list[tuple[Any, ...]]:
    """``(name, bytes, lowest rank holding it, dtype, shape)`` of every tensor of the model.

    Pipeline stages (``partial``) hold different names: the listing is gathered, in
    stage (rank) order; otherwise every rank holds every name and rank 0 stands for all.
    """
    mine = [(name, value.numel() * value.element_size(), value.dtype, tuple(value.shape))
            for name, value in state.items()]
    if not partial or not dist.is_initialized():
        return [(name, size, 0, dtype, shape) for name, size, dtype, shape in mine]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    listing, known = [], set()
    for rank, entries in enumerate(everyone):
        for name, size, dtype, shape in entries:
            if name not in known:
                known.add(name)
                listing.append((name, size, rank, dtype, shape))
    return listing


def whole_on_main(value: torch.Tensor | None, owner: int, dtype: torch.dtype,
                   shape: tuple[int, ...], main: bool, device: torch.device) -> torch.Tensor | None:
    """The whole tensor on rank 0 (None elsewhere). Every rank holding a DTensor takes part
    in gathering it; a tensor rank 0 does not hold comes from ``owner`` point to point
    (received on ``device``, where the process group communicates)."""
    from paratrain.distributed.dtensor import whole

    tensor = None
    if value is not None:
        with torch.no_grad():
            if _rows_sharded(value):
                tensor = _rows_on_main(value, main)
            else:
                tensor = whole(value).detach()
    if owner != 0:
        if dist.get_rank() == owner:
            dist.send(tensor.contiguous(), 0)
        elif main:
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(tensor, owner)
    return tensor.cpu().contiguous() if main and tensor is not None else None


def _rows_sharded(value: torch.Tensor) -> bool:
    """A DTensor split by rows over a 1-D mesh that holds rank 0 (FSDP's layout)."""
    placements = getattr(value, "placements", None)
    if placements is None or len(placements) != 1 or not placements[0].is_shard(0):
        return False
    return 0 in value.device_mesh.mesh.flatten().tolist()


def _rows_on_main(value: torch.Tensor, main: bool) -> torch.Tensor | None:
    """For :func:`_rows_sharded` values: each rank sends its rows straight into their place
    in rank 0's whole tensor, so no rank holds a gathered copy it then drops, and rank 0
    no padded buffer (``full_tensor`` holds about three copies at once). None elsewhere."""
    ranks = value.device_mesh.mesh.flatten().tolist()
    rows = value.shape[0]
    step = -(-rows // len(ranks))  # torch.chunk's split, as Shard(0) and FSDP use
    local = value.to_local().detach()
    if not main:
        if local.numel():
            dist.send(local.contiguous(), 0)
        return None
    whole = torch.empty(value.shape, dtype=local.dtype, device=local.device)
    for index, rank in enumerate(ranks):
        start = min(index * step, rows)
        piece = whole.narrow(0, start, min(rows, start + step) - start)
        if rank == dist.get_rank():
            piece.copy_(local)
        elif piece.numel():
            dist.recv(piece, rank)
    return whole
