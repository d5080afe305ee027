"""Which checkpoint a resume loads: the newest one that is intact on every rank.

Each rank checks the newest checkpoint itself (its small file loads safely; a
sharded one's files are all there and long enough, see
:func:`~paratrain.checkpoint.shard_files.problem`), then the ranks compare
verdicts in one small all-gather. All load it, or all skip it for the previous
one with one warning, so no rank loads another step and none waits for a load
the others gave up. The check reads no tensor of a shard directory, and no state
is changed before the ranks agree.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint import shard_files
from paratrain.checkpoint.files import (
    CheckpointError,
    CorruptCheckpoint,
    checkpoint_name,
    list_checkpoints,
    safe_load,
)

__all__ = ["inspect", "resume_newest"]

OK, DAMAGED, UNUSABLE = 0, 1, 2
_STEP = re.compile(r"^step-(\d+)\.pt$")

Agree = Callable[[torch.Tensor], torch.Tensor]
"""A strategy's ``agree_flags``: this rank's flags -> every rank's, stacked by rank."""


def inspect(path: Path) -> tuple[int, dict[str, Any] | None, CheckpointError | None]:
    """``(OK, state, None)``, ``(DAMAGED, None, error)`` or ``(UNUSABLE, None, error)``.

    Damaged: the file or its shards are truncated, missing, unreadable or not a
    checkpoint (an older checkpoint may be intact). Unusable: anything else (a refused pickle, a
    file of another program), which older checkpoints would share.
    """
    try:
        state = safe_load(path)
        if state.get("sharded"):
            problem = shard_files.problem(path.parent / state["sharded"])
            if problem:
                raise CorruptCheckpoint(f"checkpoint {path} is damaged: {problem}")
    except CorruptCheckpoint as exc:
        return DAMAGED, None, exc
    except CheckpointError as exc:
        return UNUSABLE, None, exc
    except OSError as exc:  # unreadable here (permissions, I/O error): the others must know
        return DAMAGED, None, CorruptCheckpoint(
            f"checkpoint {path} cannot be read ({type(exc).__name__}: {exc.strerror or exc})")
    return OK, state, None


def resume_newest(directory: str | os.PathLike, *,
                  load: Callable[[Path, dict[str, Any]], None], agree: Agree,
                  warn: Callable[[str], None]) -> Path | None:
    """Load the newest checkpoint in ``directory`` intact on every rank; its path, or
    None when there is none (collective: every rank calls it).

    ``load(path, state)`` restores it (``state``: the small file, already read); a
    ``CorruptCheckpoint`` from it (DCP failed to read a shard, on every rank) falls
    back too. With nothing intact left, ``CorruptCheckpoint`` names the oldest one.
    """
    candidates = list_checkpoints(directory)
    for index in range(len(candidates) - 1, -1, -1):
        path = candidates[index]
        state, damage = _inspect_everywhere(path, agree)
        if damage is None:
            try:
                load(path, state)
                return path
            except CorruptCheckpoint as exc:
                damage = exc
        if index == 0:
            raise CorruptCheckpoint(
                f"{damage}; no intact checkpoint is left to resume from: restore the damaged "
                f"files, or move the checkpoints out of {directory} to start over") from None
        warn(f"paratrain: warning: {damage}; resuming from the previous checkpoint "
             f"{candidates[index - 1]} instead")
    _agreed_rows(None, OK, agree)  # every rank must find nothing too
    return None


def _inspect_everywhere(path: Path, agree: Agree,
                        ) -> tuple[dict[str, Any] | None, CheckpointError | None]:
    """This rank's verdict on ``path`` and the others': (state, None) when all can load it,
    (None, error) when it is damaged somewhere; raises when it is unusable somewhere."""
    code, state, error = inspect(path)
    codes = _agreed_rows(path, code, agree)
    worst = max(codes)
    if worst == OK:
        return state, None
    ranks = ", ".join(str(rank) for rank, c in enumerate(codes) if c == worst)
    if worst == UNUSABLE:
        if code == UNUSABLE:
            raise error
        raise CheckpointError(f"checkpoint {path} cannot be used on rank(s) {ranks} (their "
                              "error says why); every rank must be able to read it")
    if code == DAMAGED:
        return None, error
    return None, CorruptCheckpoint(f"checkpoint {path} is damaged as rank(s) {ranks} see it "
                                   "(this rank reads it whole: do the nodes share the "
                                   "checkpoint_dir?)")


def _agreed_rows(path: Path | None, code: int, agree: Agree) -> list[int]:
    """Every rank's verdict code; CheckpointError when the ranks look at different steps."""
    step = int(_STEP.match(path.name).group(1)) if path is not None else -1
    rows = agree(torch.tensor([code, step], dtype=torch.int64)).reshape(-1, 2).cpu()
    steps = rows[:, 1].tolist()
    if len(set(steps)) > 1:
        seen = ", ".join(f"rank {rank}: {checkpoint_name(s) if s >= 0 else 'none'}"
                         for rank, s in enumerate(steps))
        raise CheckpointError(
            f"the ranks see different newest checkpoints ({seen}), so they would resume from "
            "different steps; give every node the same checkpoint_dir on a shared file system")
    return [int(c) for c in rows[:, 0].tolist()]
