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
import tempfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

_NAME = re.compile(r"^step-(\d{9,})\.pt$")
FORMAT_VERSION = 1
_PICKLE_PROTO = b"\x80"  # first byte of every pickle of protocol 2 or later


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and the reason."""


class UnreadableCheckpoint(CheckpointError):
    """The file itself is damaged (corrupt, truncated, not a checkpoint): nothing was loaded."""


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


def safe_load(path: str | os.PathLike) -> dict[str, Any]:
    """Load a checkpoint without executing code from it; CheckpointError if unusable."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(1)
    if not zipfile.is_zipfile(path) and head != _PICKLE_PROTO:
        # torch.save writes a zip archive (or, in its legacy format, a pickle); anything
        # else would reach the unpickler and be misreported as "objects other than tensors".
        size = path.stat().st_size
        raise UnreadableCheckpoint(
            f"checkpoint {path} is corrupt or truncated: not a torch.save archive "
            f"({size} bytes); delete it to resume from an earlier checkpoint"
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"checkpoint {path} was refused: it contains objects other than tensors and plain "
            f"containers ({first_sentence(exc)}); only load files you trust with other tools"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise UnreadableCheckpoint(
            f"checkpoint {path} is corrupt or truncated: {first_sentence(exc)}"
        ) from None
    if not isinstance(state, dict) or state.get("format") != "paratrain":
        raise CheckpointError(f"checkpoint {path} was not written by paratrain")
    return state


def first_sentence(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message, ended at a sentence, never mid-word."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else type(exc).__name__
    if len(line) <= limit:
        return line
    cut = line.rfind(". ", 0, limit)
    return line[: cut + 1] if cut > 0 else line[: line.rfind(" ", 0, limit)] + " ..."


def describe_mismatch(expected: Mapping[str, Any], found: Mapping[str, Any]) -> str:
    """What differs between two state dicts: first missing and unexpected key, first shape.

    ``expected`` is what the model holds, ``found`` what the checkpoint holds; values are
    tensors (or anything with ``.shape``). Returns "" when names and shapes agree.
    """
    parts = []
    missing = [k for k in expected if k not in found]
    unexpected = [k for k in found if k not in expected]
    if missing:
        parts.append(f"missing key {missing[0]!r}" + (f" and {len(missing) - 1} more"
                                                       if len(missing) > 1 else ""))
    if unexpected:
        parts.append(f"unexpected key {unexpected[0]!r}" + (f" and {len(unexpected) - 1} more"
                                                             if len(unexpected) > 1 else ""))
    for key, value in expected.items():
        shape, other = getattr(value, "shape", None), getattr(found.get(key), "shape", None)
        if shape is not None and other is not None and tuple(shape) != tuple(other):
            parts.append(f"shape of {key!r} is {tuple(other)} in the checkpoint, "
                         f"{tuple(shape)} in the model")
            break
    return "; ".join(parts)


def check_writable(directory: str | os.PathLike) -> None:
    """ValueError in one line unless ``directory`` is (or can become) a writable directory."""
    path = Path(directory)
    if path.exists() and not path.is_dir():
        raise ValueError(f"checkpoint_dir {str(path)!r} is a file, not a directory; "
                         "pass a directory path (it is created when missing)")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ValueError(f"checkpoint_dir {str(path)!r} cannot be written ({reason}); "
                         "choose a directory this user can write") from None


def prune(directory: str | os.PathLike, keep: int) -> None:
    """Delete all but the ``keep`` newest complete checkpoints."""
    for old in list_checkpoints(directory)[:-keep]:
        old.unlink(missing_ok=True)


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
