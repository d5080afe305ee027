"""Checkpoint files: atomic writes, safe loads, and RNG state that travels as tensors.

A checkpoint is one file ``step-<global_step>.pt`` in a directory. It is
written to a temporary name, flushed to disk and renamed, so a file with the
final name is always complete and a crash mid-write leaves the previous one
untouched. Files are loaded with ``weights_only=True``: a crafted pickle cannot
run code, it is refused.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

_NAME = re.compile(r"^step-(\d{9,})\.pt$")
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and the reason."""


class CorruptCheckpoint(CheckpointError):
    """The file itself is damaged or not a checkpoint (an older one may still be usable)."""


def checkpoint_name(global_step: int) -> str:
    return f"step-{global_step:09d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[Path]:
    """Complete checkpoints in ``directory``, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir() if (m := _NAME.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in ``directory``, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def atomic_save(state: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``state`` to ``path`` so that ``path`` is either the old file or the complete new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            # Data must be on disk before the rename makes the file visible as complete.
            os.fsync(f.fileno())
        os.replace(tmp_name, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    return path


# torch.save writes a zip archive; the legacy format is a pickle (protocol >= 2).
_MAGIC = (b"PK\x03\x04", b"\x80")


def _refusal_reason(exc: Exception) -> str:
    """What torch's weights-only loader refused, without its boilerplate around it."""
    paragraphs = [p for p in re.split(r"\n\s*\n", str(exc)) if p.strip()]
    middle = [p for p in paragraphs if not p.startswith(("Weights only load failed",
                                                         "Check the documentation"))]
    reason = " ".join(" ".join(middle).split()).split("WeightsUnpickler error:")[-1].strip()
    return reason.rstrip(".") or type(exc).__name__


def safe_load(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint without executing code from it; CheckpointError if unusable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(4)
    if not head:
        raise CorruptCheckpoint(f"checkpoint {path} is empty (truncated)")
    if not head.startswith(_MAGIC):
        raise CorruptCheckpoint(
            f"checkpoint {path} is not a torch checkpoint (it starts with {head!r}); "
            "move it out of the checkpoint directory"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        if not str(exc).startswith("Weights only load failed"):
            raise CorruptCheckpoint(f"checkpoint {path} is corrupt or truncated: "
                                    f"{_refusal_reason(exc)}") from None
        raise CheckpointError(
            f"checkpoint {path} was refused: it contains objects other than tensors and plain "
            f"containers ({_refusal_reason(exc)}); only load files you trust with other tools"
        ) from None
    except Exception as exc:  # noqa: BLE001 - torch raises many types for damaged files
        # torch's first sentence says what failed; the rest is advice about its internals.
        reason = " ".join(str(exc).split()).split(". ")[0].rstrip(".") or type(exc).__name__
        raise CorruptCheckpoint(f"checkpoint {path} is corrupt or truncated "
                                f"({type(exc).__name__}: {reason})") from None
    if not isinstance(state, dict) or state.get("format") != "paratrain":
        raise CheckpointError(f"checkpoint {path} was not written by paratrain")
    return state


def describe_mismatch(expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]],
                      *, partial: bool = False) -> str | None:
    """What differs between a model's ``name -> shape`` and a checkpoint's; None if they fit.

    ``partial``: the model holds only part of what was saved (a pipeline stage),
    so names only in the checkpoint are expected.
    """
    problems = []
    missing = [k for k in expected if k not in found]
    unexpected = [] if partial else [k for k in found if k not in expected]
    for label, keys in (("missing key", missing), ("unexpected key", unexpected)):
        if keys:
            more = f" (and {len(keys) - 1} more)" if len(keys) > 1 else ""
            problems.append(f"{label} {keys[0]!r}{more}")
    for key, shape in expected.items():
        if key in found and tuple(found[key]) != tuple(shape):
            problems.append(f"shape of {key!r} is {list(found[key])} in the checkpoint "
                            f"but {list(shape)} in the model")
            break
    return "; ".join(problems) or None


def optimizer_types(optimizers: list[Any]) -> list[str]:
    """The class name of each optimizer's update rule, as a checkpoint records it.

    A ``ZeroRedundancyOptimizer`` (strategy ``zero1``) is named by the optimizer it
    shards (its ``optim``), so that a resume under another strategy compares the same.
    """
    names = []
    for optimizer in optimizers:
        inner = getattr(optimizer, "optim", None)
        names.append(type(inner if isinstance(inner, torch.optim.Optimizer) else optimizer)
                     .__name__)
    return names


def check_optimizer_types(path: str | os.PathLike, state: dict[str, Any],
                          optimizers: list[Any]) -> None:
    """CheckpointError when ``state`` was written by another type of optimizer.

    Its state would load without an error (``load_state_dict`` takes any keys) and the
    first step would fail on a missing one (SGD after Adam: ``KeyError: 'momentum'``).
    Checkpoints written before the types were recorded are not checked.
    """
    saved = state.get("optimizer_types")
    if saved is None:
        return
    for index, (was, now) in enumerate(zip(saved, optimizer_types(optimizers))):
        if was != now:
            which = f" {index}" if len(optimizers) > 1 else ""
            raise CheckpointError(
                f"checkpoint {path} was written with optimizer {was} but this run's "
                f"optimizer{which} is {now}; resume with {was} (one's state does not fit "
                "the other), or start from another checkpoint_dir")


def check_directory(directory: str | os.PathLike) -> None:
    """Fail now, in one line, if checkpoints cannot be written to ``directory``.

    Creates the directory (as the first save would) and writes a probe file,
    because permission bits do not tell (root ignores them; read-only mounts).
    """
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"checkpoint_dir={str(directory)!r} is a file, not a directory; "
                         "pass a directory path (it is created if missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".paratrain-write-test.", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"checkpoint_dir={str(directory)!r} cannot be written "
                         f"({exc.strerror or exc}); pass a writable directory") from None


def prune(directory: str | os.PathLike, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints."""
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)


def commit(state: dict[str, Any], path: Path, keep: int) -> Path:
    """Rank 0: write the small file (the commit point), then prune older checkpoints."""
    written = atomic_save(state, path)
    prune(path.parent, keep)
    prune_sharded(path.parent)
    return written


def prune_sharded(directory: Path) -> None:
    """Delete shard directories whose small checkpoint file was pruned (or never finished)."""
    kept = {p.with_suffix(".dcp").name for p in list_checkpoints(directory)}
    for shard_dir in directory.glob("step-*.dcp"):
        if shard_dir.is_dir() and shard_dir.name not in kept:
            shutil.rmtree(shard_dir, ignore_errors=True)


# -- RNG state as one fixed-size uint8 tensor, so ranks can all_gather it ---------

def _python_rng_tensor() -> torch.Tensor:
    version, internal, gauss = random.getstate()
    values = [version, *internal, 0 if gauss is None else 1]
    body = torch.tensor(values, dtype=torch.int64)
    gauss_t = torch.tensor([0.0 if gauss is None else gauss], dtype=torch.float64)
    return torch.cat([body.view(torch.uint8), gauss_t.view(torch.uint8)])


def _set_python_rng(blob: torch.Tensor) -> None:
    values = blob[:-8].view(torch.int64).tolist()
    gauss = blob[-8:].view(torch.float64).item() if values[-1] else None
    random.setstate((values[0], tuple(values[1:-1]), gauss))


def _numpy_rng_tensor() -> torch.Tensor:
    name, keys, pos, has_gauss, cached = np.random.get_state()
    assert name == "MT19937"
    head = torch.tensor([pos, has_gauss], dtype=torch.int64).view(torch.uint8)
    key = torch.from_numpy(keys.astype(np.int64)).view(torch.uint8)
    gauss = torch.tensor([cached], dtype=torch.float64).view(torch.uint8)
    return torch.cat([head, key, gauss])


def _set_numpy_rng(blob: torch.Tensor) -> None:
    pos, has_gauss = blob[:16].view(torch.int64).tolist()
    keys = blob[16:-8].view(torch.int64).numpy().astype(np.uint32)
    cached = blob[-8:].view(torch.float64).item()
    np.random.set_state(("MT19937", keys, pos, has_gauss, cached))


def rng_state() -> torch.Tensor:
    """Torch (CPU and current CUDA device), Python and NumPy RNG states packed into uint8."""
    parts = [torch.get_rng_state(), _python_rng_tensor(), _numpy_rng_tensor()]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        parts.append(torch.cuda.get_rng_state())
    return torch.cat(parts)


def set_rng_state(blob: torch.Tensor) -> None:
    """Restore what :func:`rng_state` packed."""
    sizes = [torch.get_rng_state().numel(), _python_rng_tensor().numel(), _numpy_rng_tensor().numel()]
    torch_part, py_part, np_part = blob[: sizes[0]], blob[sizes[0] : sizes[0] + sizes[1]], blob[
        sizes[0] + sizes[1] : sum(sizes)
    ]
    torch.set_rng_state(torch_part.clone())
    _set_python_rng(py_part.clone())
    _set_numpy_rng(np_part.clone())
    cuda_part = blob[sum(sizes) :]
    if cuda_part.numel() and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda_part.clone())
