"""Failures of checkpoint I/O as one line: a full or read-only disk, DCP's errors.

``torch.distributed.checkpoint`` raises ``CheckpointException``, a ``BaseException``
whose message holds every failed rank's traceback; ``torch.save`` on a full disk
raises a ``RuntimeError`` about zip offsets while handling the ``OSError`` that says
why. :func:`write_error` turns either into the line a user acts on.
"""

from __future__ import annotations

import os
from pathlib import Path

from paratrain.checkpoint.files import CheckpointError

__all__ = ["failure_reason", "is_dcp_failure", "os_error", "write_error"]


def write_error(path: str | os.PathLike, cause: int | BaseException) -> CheckpointError:
    """The one line for a checkpoint that could not be written (disk full, read-only).

    ``cause`` is the exception (DCP's ``CheckpointException`` holding each rank's
    failure, or what ``torch.save`` raised) or, on ranks that only learned of rank
    0's failure, its errno (-1 when it had none).
    """
    path = Path(path)
    if isinstance(cause, int):
        reason = os.strerror(cause) if cause > 0 else "rank 0 failed to write it"
    else:
        found = os_error(cause)
        reason = found.strerror if found is not None else failure_reason(cause)
    return CheckpointError(
        f"cannot write checkpoint {path} ({reason}); free space in {path.parent} or make it "
        "writable, or pass another checkpoint_dir; the previous checkpoint is kept")


def os_error(exc: BaseException | None) -> OSError | None:
    """The OSError with an errno behind ``exc`` (torch's zip writer raises a RuntimeError
    while handling the OSError of a full disk), or None."""
    while exc is not None:
        if isinstance(exc, OSError) and exc.errno:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def is_dcp_failure(exc: BaseException) -> bool:
    """True for ``torch.distributed.checkpoint``'s ``CheckpointException``."""
    from torch.distributed.checkpoint.api import CheckpointException

    return isinstance(exc, CheckpointException)


def failure_reason(exc: BaseException) -> str:
    """One line for what failed: ``rank 1: FileNotFoundError: [Errno 2] ...`` for a
    ``CheckpointException`` (the lowest failed rank; ``and N more ranks``), else the
    exception's own first line."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        more = f" (and {len(failures) - 1} more rank{'s' if len(failures) > 2 else ''})" \
            if len(failures) > 1 else ""
        return f"rank {rank}: {_one_line(inner)}{more}"
    return _one_line(exc)


def _one_line(exc: BaseException) -> str:
    exc = os_error(exc) or exc  # the disk's reason behind torch's own error
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
