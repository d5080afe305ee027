"""Checkpoint writes that run beside training (``RunConfig(async_save=True)``).

The state is copied off the device when the save is called, so the checkpoint holds
the values of that step whatever training does next; only the copy's write to disk
(``torch.save``, fsync, the atomic rename) runs on a thread. One write is in flight
at a time: the next save, ``Run.close`` and a SIGTERM stop wait for it first, and an
error in the background is raised there, as one line naming the checkpoint.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from paratrain.checkpoint.failures import failure_reason
from paratrain.checkpoint.files import CheckpointError, commit
from paratrain.checkpoint.shard_files import publish

__all__ = ["BackgroundWriter", "snapshot", "write_job"]


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` that shares no memory with it: tensors cloned to the CPU.

    Containers are rebuilt and other leaves deep-copied, because optimizer and
    scheduler state dicts return live references that the next step changes.
    """
    copies: dict[int, torch.Tensor] = {}
    result = _copy(obj, copies)
    if any(t.is_cuda for t in copies.values()) and torch.cuda.is_available():
        torch.cuda.synchronize()  # the copies were queued without blocking
    return result


def _copy(obj: Any, copies: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        key = id(obj)
        if key not in copies:
            # A tensor seen twice (tied weights) stays one tensor in the copy.
            copies[key] = obj.detach().to("cpu", copy=True, non_blocking=obj.is_cuda)
        return copies[key]
    if isinstance(obj, dict):
        return type(obj)((k, _copy(v, copies)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(_copy(v, copies) for v in obj)
    return copy.deepcopy(obj)


def write_job(shards: Any, state: dict[str, Any] | None, path: Path,
              keep: int, *, staged: Path | None = None) -> Callable[[], None]:
    """The background part of a save: every rank's shards (a DCP future, written into
    ``staged``), then, on rank 0 (``state`` given), the shards renamed to their final
    directory and the small file that marks the checkpoint complete."""
    def job() -> None:
        if shards is not None:
            # DCP's future ends once every rank's shards and the metadata are on disk.
            shards.result()
        if state is not None:
            if staged is not None:
                publish(staged, path.parent / state["sharded"], path)
            commit(state, path, keep)
    return job


class BackgroundWriter:
    """Runs one checkpoint job at a time on a thread; its error waits for :meth:`wait`.

    The thread is not a daemon: a process that ends (an uncaught exception, the end
    of the script) finishes the write before the interpreter exits.
    """

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._label = ""
        self._error: BaseException | None = None

    @property
    def pending(self) -> bool:
        """A job was started and not yet waited for."""
        return self._thread is not None

    def start(self, job: Callable[[], None], *, label: str) -> None:
        """Wait for the previous job (raising its error), then run ``job`` on a thread."""
        self.wait()
        self._label = label
        self._thread = threading.Thread(target=self._run, args=(job,),
                                        name="paratrain-checkpoint", daemon=False)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread
            self._error = exc

    def wait(self) -> None:
        """Block until the job in flight is done; CheckpointError if it failed."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        thread.join()
        error, self._error = self._error, None
        if error is not None:
            # DCP's CheckpointException holds each rank's traceback: its first failure.
            reason = failure_reason(error)[:400]
            raise CheckpointError(
                f"writing checkpoint {self._label} in the background failed "
                f"({reason}); the previous checkpoint is kept, "
                "fix the cause (disk space, permissions) and save again") from None
