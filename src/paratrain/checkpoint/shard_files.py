"""The files of a sharded checkpoint: checked before loading, published whole after writing.

A sharded checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory
``step-N.dcp`` beside the small file ``step-N.pt`` that rank 0 writes last.

* :func:`problem` checks a directory against its own ``.metadata`` (every file the
  metadata points into exists and is long enough) without reading the tensors, so
  a resume decides which checkpoint is intact before any state is changed.
* Shards are written into :func:`staging_dir` (``.step-N.dcp.tmp``) and renamed to
  their final name by :func:`publish` once every rank's write is complete, so a
  failed or interrupted write never sits under a checkpoint's name.
* :func:`write_staged` writes them there; a failure is one line on every rank
  (:mod:`~paratrain.checkpoint.failures`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from paratrain.checkpoint.failures import is_dcp_failure, write_error

__all__ = ["discard_staging", "problem", "publish", "staging_dir", "write_staged"]

_STAGING = ".{name}.tmp"


def problem(directory: str | os.PathLike) -> str | None:
    """What is wrong with the DCP directory's files, or None when all are there.

    Example: ``"its shard file step-000000003.dcp/__1_0.distcp is missing"``. A file
    whose bytes were changed but not its length is not found here (DCP's own read
    fails then, on every rank alike).
    """
    from torch.distributed.checkpoint import FileSystemReader

    directory = Path(directory)
    if not directory.is_dir():
        return f"its shard directory {directory.name} is missing"
    metadata_file = directory / ".metadata"
    if not metadata_file.is_file():
        return f"its shard metadata {directory.name}/.metadata is missing"
    try:
        storage = FileSystemReader(str(directory)).read_metadata().storage_data
        needed: dict[str, int] = {}
        for info in storage.values():
            end = int(info.offset) + int(info.length)
            needed[info.relative_path] = max(end, needed.get(info.relative_path, 0))
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata means a damaged checkpoint
        reason = " ".join(str(exc).split())[:200] or "empty or damaged"
        return (f"its shard metadata {directory.name}/.metadata cannot be read "
                f"({type(exc).__name__}: {reason})")
    for name in sorted(needed):
        path = directory / name
        if not path.is_file():
            return f"its shard file {directory.name}/{name} is missing"
        size = path.stat().st_size
        if size < needed[name]:
            return (f"its shard file {directory.name}/{name} is truncated "
                    f"({size} of {needed[name]} bytes)")
    return None


def staging_dir(final: Path) -> Path:
    """Where the shards of ``final`` are written before :func:`publish` renames them."""
    return final.parent / _STAGING.format(name=final.name)


def publish(staged: Path, final: Path, small: Path) -> None:
    """Rank 0, once every rank's shards are in ``staged``: move them to ``final``.

    A checkpoint already saved at this step (one a resume skipped as damaged, or
    older than the one loaded) is replaced: its small file goes first, so that no
    moment shows ``small`` beside shards that are not its own.
    """
    small.unlink(missing_ok=True)
    if final.exists():
        shutil.rmtree(final)
    os.replace(staged, final)
    _fsync_directory(final.parent)


def write_staged(write: Callable[..., Any], staged: Path, models: list[Any],
                 optimizers: list[Any], *, path: Path, strategy: Any, main: bool) -> Any:
    """Every rank's shards into ``staged`` through ``write`` (the strategy's synchronous
    or background save; collective); returns what ``write`` returns (a background
    write's future). A failure is one line naming ``path`` on every rank, as DCP
    raises it on all, and rank 0 removes the partial directory."""
    if main:
        discard_staging(staged.parent)  # writes that never finished
    strategy.barrier()  # nobody writes into a staging directory being removed
    try:
        return write(str(staged), models, optimizers)
    except BaseException as exc:
        if not is_dcp_failure(exc):
            raise
        if main:
            shutil.rmtree(staged, ignore_errors=True)
        raise write_error(path, exc) from None


def discard_staging(directory: Path, *, keep: Path | None = None) -> None:
    """Remove staging directories left by writes that never finished (rank 0)."""
    for staged in directory.glob(_STAGING.format(name="step-*.dcp")):
        if staged != keep and staged.is_dir():
            shutil.rmtree(staged, ignore_errors=True)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
