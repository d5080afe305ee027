"""One live run per checkpoint directory: ``paratrain.lock``, held by the run's rank 0.

Two runs on one ``checkpoint_dir`` would resume from each other's checkpoints and
overwrite each other's files. ``Run(checkpoint_dir=D)`` takes ``D/paratrain.lock``
at start and removes it at ``close()`` (also on errors and at interpreter exit).
The file says who holds it (host, pid, job, since when); the liveness test is the
kernel's: an ``flock`` on the open file, which a process keeps until it dies, even
by SIGKILL (where the file system has no flock, the record alone decides). A lock
file that nobody holds was left by a run that is gone:

* on this host (its pid is dead), it is taken over; silently when it is the same
  job restarted (torchrun's ``--max-restarts``, a Slurm requeue: same
  ``TORCHELASTIC_RUN_ID`` / ``SLURM_JOB_ID``), with a notice otherwise;
* from another host, where the pid cannot be checked: taken over when it is the
  same job, or when its holder stopped refreshing it (every ``HEARTBEAT_S``) more
  than ``STALE_AFTER_S`` ago; a live one is refused.

Example:
    >>> lock, notice = acquire("ckpt", job=job_of(os.environ))   # doctest: +SKIP
    >>> lock.release()                                            # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from paratrain.checkpoint.files import CheckpointError

__all__ = ["LOCK_NAME", "CheckpointDirInUse", "DirectoryLock", "acquire", "job_of"]

LOCK_NAME = "paratrain.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
_held: dict[Path, DirectoryLock] = {}  # by resolved lock path: the locks of this process


class CheckpointDirInUse(CheckpointError):
    """Another live run holds the checkpoint directory; the message names it and the fix."""


def job_of(environ: Mapping[str, str]) -> str | None:
    """What stays the same when a job restarts: the Slurm job, or torchrun's run id."""
    if environ.get("SLURM_JOB_ID"):
        return f"slurm:{environ['SLURM_JOB_ID']}"
    run_id = environ.get("TORCHELASTIC_RUN_ID", "")
    return f"torchrun:{run_id}" if run_id not in ("", "none") else None


class DirectoryLock:
    """A held ``paratrain.lock``; :meth:`release` removes it (idempotent)."""

    def __init__(self, path: Path, fd: int, record: dict[str, Any]) -> None:
        self.path = path
        self.record = record
        self._fd: int | None = fd
        self._stop = threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, name="paratrain-lock",
                                      daemon=True)
        self._beat.start()

    def _heartbeat(self) -> None:
        # The modification time tells a run on another host that this one is alive.
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def release(self) -> None:
        """Remove the file (if it is still this lock's) and let go of the flock."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        self._stop.set()
        _held.pop(self.path.resolve(), None)
        with contextlib.suppress(OSError):  # a read-only or vanished directory: leave it
            if os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                self.path.unlink()
        os.close(fd)


def acquire(directory: str | os.PathLike, *, job: str | None = None,
            ) -> tuple[DirectoryLock, str | None]:
    """Take ``directory``'s lock; ``(lock, notice)``, the notice set when a lock left by a
    run that is gone was taken over. CheckpointDirInUse when a live run holds it."""
    path = Path(directory) / LOCK_NAME
    previous = _held.get(path.resolve())
    if previous is not None:
        previous.release()  # a Run of this process that was never closed
    for _ in range(10):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise CheckpointDirInUse(_in_use(directory, _read(path))) from None
            except OSError as exc:
                if exc.errno not in _NO_FLOCK:
                    raise
                # A file system without flock (Lustre without -o flock): the record decides.
            if os.fstat(fd).st_ino != _inode(path):
                os.close(fd)  # released and removed since we opened it: open the new one
                continue
            holder = _read(path)
            notice = _judge(directory, holder, job, age_s=time.time() - os.fstat(fd).st_mtime)
            record = {"host": socket.gethostname(), "pid": os.getpid(),
                      "pid_start": _start_time(os.getpid()), "job": job,
                      "since": datetime.datetime.now().isoformat(timespec="seconds"),
                      "token": uuid.uuid4().hex}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(fd)
            raise
        lock = DirectoryLock(path, fd, record)
        _held[path.resolve()] = lock
        return lock, notice
    raise CheckpointDirInUse(f"checkpoint_dir {str(directory)!r}: its lock {path} keeps being "
                             "replaced by other runs; run one at a time")


def _judge(directory: Any, holder: dict[str, Any] | None, job: str | None, *,
           age_s: float) -> str | None:
    """None to take a free lock quietly, a notice to take over a stale one; raises when
    its holder may be alive (flock is free but the record says otherwise)."""
    if not holder:
        return None  # new, or emptied mid-write by a run that died
    same_job = job is not None and holder.get("job") == job
    if holder.get("host") == socket.gethostname():
        if _alive(holder.get("pid"), holder.get("pid_start")):
            # The flock was free (or unsupported), yet its holder lives.
            raise CheckpointDirInUse(_in_use(directory, holder))
        restarted = same_job or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0
        return None if restarted else _stale(directory, holder, "its process is gone")
    if same_job:
        return None
    if age_s > STALE_AFTER_S:
        return _stale(directory, holder, f"not refreshed for {age_s:.0f} s")
    raise CheckpointDirInUse(_in_use(directory, holder))


def _in_use(directory: Any, holder: dict[str, Any] | None) -> str:
    who = (f"host {holder.get('host')}, pid {holder.get('pid')}, since {holder.get('since')}"
           if holder else "its lock file is being written")
    return (f"checkpoint_dir {str(directory)!r} is in use by another run ({who}); two runs "
            "would resume from and overwrite each other's checkpoints: wait for it to end or "
            "pass another checkpoint_dir (if that run is gone, delete "
            f"{Path(directory) / LOCK_NAME})")


def _stale(directory: Any, holder: dict[str, Any], why: str) -> str:
    return (f"paratrain: notice: checkpoint_dir {str(directory)!r} was locked by a run that "
            f"ended without releasing it (host {holder.get('host')}, pid {holder.get('pid')}, "
            f"since {holder.get('since')}; {why}); taking it over")


def _read(path: Path) -> dict[str, Any] | None:
    try:
        holder = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def _inode(path: Path) -> int | None:
    try:
        return os.stat(path).st_ino
    except FileNotFoundError:
        return None


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]


def _alive(pid: Any, started: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's process: alive
    return started is None or _start_time(pid) in (None, started)


@atexit.register
def _release_all() -> None:
    """A script that ends without ``run.close()`` leaves no lock behind."""
    for lock in list(_held.values()):
        lock.release()
