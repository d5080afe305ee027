"""Semi-synchronous state in a sharded checkpoint, resumed bit for bit.

Between two outer steps the replica groups hold different parameters and optimizer
state, which a sharded checkpoint (one copy per shard) cannot hold. So every rank also
writes its own file into the checkpoint's shard directory,
``semisync-<rank>of<world>.pt``: its local pieces of the parameters and of the
optimizer's state, and the outer state (the step within ``H``, the snapshot ``s``, the
outer momentum, a fragment's received sum not yet applied). The shards beside it hold
replica group 0's model and optimizer (written from the lowest ranks), so the
checkpoint also loads as an ordinary one into any other layout.

A resume reads the shards, then this rank's file over them. It needs the layout that
wrote it: another number of replica groups (or world size) is refused in one line; a
checkpoint without these files (written without ``semi_sync``) starts the outer state
afresh from its (equal) parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from paratrain.strategies.semisync.outer import OuterSync, local_piece

__all__ = ["load_rank_state", "save_rank_state"]

_FILE = "semisync-{rank}of{world}.pt"


def _parameters(optimizer: torch.optim.Optimizer) -> list[torch.nn.Parameter]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return local_piece(value).detach().cpu().clone()
    return value


def save_rank_state(directory: str | Path, outer: OuterSync, optimizer: torch.optim.Optimizer,
                    *, rank: int, world_size: int) -> None:
    """Write this rank's file into ``directory`` (the shard directory being written)."""
    params = _parameters(optimizer)
    state = {"format": "paratrain-semisync", "version": 1, "replicas": outer.replicas,
             "world_size": world_size, "outer": outer.state_dict(),
             "params": [_clone(p) for p in params],
             "optimizer": [{k: _clone(v) for k, v in optimizer.state.get(p, {}).items()}
                           for p in params]}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    torch.save(state, directory / _FILE.format(rank=rank, world=world_size))


def load_rank_state(directory: str | Path, outer: OuterSync, optimizer: torch.optim.Optimizer,
                    *, rank: int, world_size: int) -> bool:
    """Put this rank's file over what the shards loaded; False when the checkpoint has
    none (written without semi_sync). ValueError in one line for another layout."""
    directory = Path(directory)
    written = sorted(directory.glob(_FILE.format(rank="*", world="*")))
    if not written:
        return False
    file = directory / _FILE.format(rank=rank, world=world_size)
    if not file.is_file():
        raise ValueError(f"checkpoint {directory.name} holds semi-synchronous state of "
                         f"{len(written)} process(es), not of this world of {world_size}: "
                         "resume with the same world size and dp_replicate")
    state = torch.load(file, map_location="cpu", weights_only=True)
    mode = type(outer.mode).__name__
    saved = state["outer"]
    wrote = (f"{saved['kind']}(every={saved['every']}) over {state['replicas']} replica "
             f"group(s), {saved['fragments']} fragment(s)")
    if (state["replicas"], saved["kind"], saved["every"], saved["fragments"]) != (
            outer.replicas, mode, outer.every, outer.num_fragments):
        raise ValueError(f"checkpoint {directory.name} was written by {wrote}; this run has "
                         f"{mode}(every={outer.every}) over {outer.replicas}, "
                         f"{outer.num_fragments} fragment(s): resume with the same "
                         "dp_replicate and semi_sync (each group's own state is in it)")
    params = _parameters(optimizer)
    if len(state["params"]) != len(params):
        raise ValueError(f"checkpoint {directory.name} holds semi-synchronous state of "
                         f"{len(state['params'])} parameters, the optimizer steps "
                         f"{len(params)}; resume with the same model and optimizer")
    with torch.no_grad():
        for p, value, saved_state in zip(params, state["params"], state["optimizer"]):
            local_piece(p).copy_(value)
            _load_optimizer_state(optimizer, p, saved_state)
    outer.load_state_dict(saved)
    return True


def _load_optimizer_state(optimizer: torch.optim.Optimizer, param: torch.nn.Parameter,
                          saved: dict[str, Any]) -> None:
    own = optimizer.state[param]
    for key, value in saved.items():
        current = own.get(key)
        if not isinstance(value, torch.Tensor):
            own[key] = value
        elif isinstance(current, torch.Tensor):
            local_piece(current).copy_(value)
        elif hasattr(param, "to_local") and value.dim() > 0:
            from torch.distributed.tensor import DTensor

            own[key] = DTensor.from_local(value.to(local_piece(param).device),
                                          param.device_mesh, param.placements,
                                          shape=param.shape, stride=param.stride())
        else:
            own[key] = value.to(local_piece(param).device if value.dim() > 0 else value.device)
