"""How a worker ends: SIGTERM becomes a checkpoint, known errors become one line.

``GracefulStop``
    With a checkpoint directory, SIGTERM (what torchrun's agent, a scheduler
    or ``kill`` send) and SIGINT (Ctrl-C, which ``paratrain launch`` forwards
    to its workers) no longer kill the worker mid-step: the flag is agreed
    on by all ranks, every rank finishes the same optimizer step, a checkpoint
    is written and the process exits with 143 (128 + SIGTERM) or 130 (SIGINT). Under
    ``paratrain launch --max-restarts N`` the restarted job resumes from it.
    The agreement is a one-element all-reduce started after each step and
    read after the next one, so it overlaps training instead of waiting.
    A rank blocked in a collective (its peer is gone) cannot take another step:
    if the stop is not agreed within ``PARATRAIN_TERM_GRACE_S`` (default 10 s)
    the process exits with 143 anyway, as it would have without the handler.

``requeue_signal`` (Slurm preemption / time limit)
    The requeue signal (``PARATRAIN_REQUEUE_SIGNAL``, default SIGUSR1, which
    ``paratrain slurm`` asks Slurm to send 90 s before the time limit) stops the
    run the same way; then rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` and every
    rank exits with 0: the requeued job resumes from that checkpoint. Outside Slurm
    (or when ``scontrol`` fails) the exit code is 128 + the signal. The launcher
    forwards it to its workers (:func:`forward_to_children`); a worker holds it from
    start-up (:func:`hold`) so that one arriving before ``Run()`` is not lost.

``install_excepthook``
    Errors that paratrain raises for bad input or a lost peer print as one
    line ``paratrain: <message>`` instead of a traceback
    (``PARATRAIN_TRACEBACK=1`` shows it), and every uncaught error is recorded
    in torchrun's error file so that ``paratrain launch`` can quote it. Under
    ``paratrain launch`` (without ``--max-restarts``) the worker does not print
    it: the launcher prints the error of the rank that failed first, once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

EXIT_SIGTERM = 128 + signal.SIGTERM
EXIT_SIGINT = 128 + signal.SIGINT
ENV_GRACE = "PARATRAIN_TERM_GRACE_S"
# Set by ``paratrain launch`` for its workers: it reports their errors itself.
ENV_LAUNCHED = "PARATRAIN_LAUNCHED"
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_held: set[int] = set()  # requeue signals received before a GracefulStop took them over
_PACKAGE_DIR = str(Path(__file__).resolve().parents[1])  # the package root


class GracefulStop:
    """SIGTERM / SIGINT handling agreed across ranks.

    Args:
        group: process group for the agreement (None for a single process).
        enabled: install the handler (needs the main thread).
        grace_s: seconds the ranks have to agree (``PARATRAIN_TERM_GRACE_S``).
        requeue_signal: the signal that stops and requeues (None: not handled).
        slurm_job_id: the Slurm job to requeue (None outside Slurm).
        main: this rank runs ``scontrol requeue`` (rank 0).
    """

    def __init__(self, *, group: Any, enabled: bool, grace_s: float = 10.0,
                 requeue_signal: int | None = None, slurm_job_id: str | None = None,
                 main: bool = True) -> None:
        self.group = group
        self.requeue_signal = signal.Signals(requeue_signal) if requeue_signal else None
        self.slurm_job_id = slurm_job_id
        self.main = main
        self._exit_code: int | None = None
        self.requested = False
        self.agreed = False
        self.signal = signal.SIGTERM
        """The signal that asked for the stop (the last one received)."""
        self._flag = torch.zeros(1, dtype=torch.int32)
        self._work: Any = None
        self._previous: Any = None
        self._wakeup: tuple[int, int, int] | None = None
        self.installed = False
        if enabled and threading.current_thread() is threading.main_thread():
            self.grace_s = grace_s
            self._previous = {sig: signal.signal(sig, self._on_signal) for sig in self._signals}
            self.installed = True
            if self.requeue_signal is not None and int(self.requeue_signal) in _held:
                _held.discard(int(self.requeue_signal))
                self._on_signal(int(self.requeue_signal), None)
            self._start_watchdog()

    def _start_watchdog(self) -> None:
        # Python runs the handler only when the main thread returns to the interpreter;
        # the wakeup fd tells this thread at once, even while the main thread waits in C++.
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            old = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except ValueError:
            os.close(read_fd), os.close(write_fd)
            return
        self._wakeup = (read_fd, write_fd, old)
        threading.Thread(target=self._watch, args=(read_fd,), daemon=True,
                         name="paratrain-sigterm").start()

    def _watch(self, read_fd: int) -> None:
        try:
            while True:
                received = os.read(read_fd, 64)
                if any(int(sig) in received for sig in self._signals):
                    break
                if not self.installed:
                    return  # woken by close()
            time.sleep(self.grace_s)
            if self.installed and not self.agreed:
                print(f"paratrain: {self.signal.name}; no step finished within "
                      f"{self.grace_s:g} s ({ENV_GRACE}), exiting without a checkpoint",
                      file=sys.stderr, flush=True)
                os._exit(self.exit_code)
            # Until close(), a second signal (Slurm's and the launcher's copy) still writes
            # to the pipe: a closed read end would print a BrokenPipeError.
            while self.installed:
                os.read(read_fd, 64)
        finally:
            os.close(read_fd)

    @property
    def _signals(self) -> tuple[int, ...]:
        extra = (self.requeue_signal,) if self.requeue_signal is not None else ()
        return (*_STOP_SIGNALS, *extra)

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as if the signal had ended the process; 0 once requeued."""
        return 128 + int(self.signal) if self._exit_code is None else self._exit_code

    def after_save(self) -> str:
        """After the stop's checkpoint: requeue the Slurm job on the requeue signal.

        Returns what to add to the stop line (empty for SIGTERM/SIGINT).
        """
        if self.requeue_signal is None or self.signal != self.requeue_signal:
            return ""
        if not self.slurm_job_id:
            return "; not in a Slurm job (SLURM_JOB_ID unset), nothing to requeue"
        if not self.main:
            self._exit_code = 0  # rank 0 requeues; its failure fails the job
            return ""
        problem = requeue_job(self.slurm_job_id)
        if problem:
            return f"; {problem}"
        self._exit_code = 0
        return f"; requeued Slurm job {self.slurm_job_id}"

    def _on_signal(self, signum: int, frame: Any) -> None:
        # Only a flag: the step in progress finishes, collectives stay paired.
        self.signal = signal.Signals(signum)
        self.requested = True

    def should_stop(self) -> bool:
        """Called after every optimizer step on every rank; True on all ranks at once."""
        if not self.installed:
            return False
        if self.group is None:
            self.agreed = self.requested
            return self.requested
        agreed = False
        if self._work is not None:
            self._work.wait()
            agreed = bool(self._flag.item())
        if agreed:
            # The flag is the highest signal any rank got: all ranks exit the same way.
            self.signal = signal.Signals(int(self._flag.item()))
            self._work = None
            self.agreed = True
            return True
        self._flag = torch.tensor([int(self.signal) if self.requested else 0], dtype=torch.int32)
        self._work = dist.all_reduce(self._flag, op=dist.ReduceOp.MAX, group=self.group,
                                     async_op=True)
        return False

    def close(self, *, wait: bool = True) -> None:
        """Finish the pending agreement (if ``wait``) and restore the previous handler."""
        work, self._work = self._work, None
        if work is not None and wait:
            try:
                work.wait()
            except RuntimeError:
                pass  # the job is failing already; that error is the one to report
        if self.installed and threading.current_thread() is threading.main_thread():
            for sig, previous in (self._previous or {}).items():
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            if self._wakeup is not None:
                _, write_fd, old = self._wakeup
                signal.set_wakeup_fd(old)
                self.installed = False
                try:
                    os.write(write_fd, b"\0")  # wakes the watchdog, which then ends
                except OSError:
                    pass
                os.close(write_fd)
            self._wakeup = None
            self.installed = False


def requeue_job(job_id: str, *, timeout_s: float = 60.0) -> str:
    """``scontrol requeue JOB_ID``; an empty string on success, else one line saying why."""
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return f"cannot requeue Slurm job {job_id}: scontrol is not on PATH"
    try:
        done = subprocess.run([scontrol, "requeue", job_id], capture_output=True, text=True,
                              timeout=timeout_s)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"scontrol requeue {job_id} failed ({summary(exc)})"
    if done.returncode != 0:
        why = summary(RuntimeError(done.stderr or done.stdout or f"exit {done.returncode}"))
        return f"scontrol requeue {job_id} failed ({why}); submit with sbatch --requeue"
    return ""


def _hold_handler(signum: int, frame: Any) -> None:
    _held.add(signum)


def hold(signum: int | None, *, received: bool = False) -> None:
    """Keep the requeue signal for the next :class:`GracefulStop` instead of dying of it
    (its default action ends the process); one that comes after training is ignored.
    ``received``: it came already (while the worker started)."""
    if signum and threading.current_thread() is threading.main_thread():
        signal.signal(signum, _hold_handler)
        if received:
            _held.add(int(signum))


def forward_to_children(signum: int | None) -> None:
    """In ``paratrain launch``: pass ``signum`` on to the worker processes instead of
    dying of it (torch's agent forwards only SIGTERM, SIGINT, SIGHUP and SIGQUIT)."""
    if not signum or threading.current_thread() is not threading.main_thread():
        return
    import psutil

    def forward(received: int, frame: Any) -> None:
        _forwarded.append(received)
        for child in psutil.Process().children():
            try:
                child.send_signal(received)
            except psutil.Error:
                pass  # already gone

    signal.signal(signum, forward)


_forwarded: list[int] = []


def forwarded() -> list[int]:
    """The signals :func:`forward_to_children` passed on so far (oldest first)."""
    return list(_forwarded)


# -- uncaught errors ------------------------------------------------------------------

def _one_line_types() -> tuple[type[BaseException], ...]:
    from paratrain.checkpoint.files import CheckpointError
    from paratrain.datasets.images import DatasetNotFound
    from paratrain.reliability.health import HealthError, PeerLostError

    return (CheckpointError, DatasetNotFound, HealthError, PeerLostError)


def _raised_in_paratrain(tb: TracebackType | None) -> bool:
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    return last is not None and last.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR)


def is_one_line(exc: BaseException) -> bool:
    """True for paratrain's own errors and the errors its checks raise (not torch's or yours)."""
    if isinstance(exc, _one_line_types()):
        return True
    return (isinstance(exc, (ValueError, RuntimeError, OSError))
            and _raised_in_paratrain(exc.__traceback__))


def summary(exc: BaseException) -> str:
    """The first line of the error's message."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def record_error_file(exc: BaseException, message: str, *, with_traceback: bool,
                      tb: TracebackType | None = None) -> bool:
    """Write torchrun's per-worker error file (``TORCHELASTIC_ERROR_FILE``), if there is one.

    torchrun prints ``py_callstack`` in its failure report; for one-line errors it
    is the message itself. ``paratrain_time`` (sub-second, unlike torchrun's
    ``timestamp``) lets the launcher tell which rank failed first. Returns True
    when the file was written.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    stack = message
    if with_traceback:
        tb = exc.__traceback__ if tb is None else tb
        stack = "".join(traceback.format_exception(type(exc), exc, tb))
    now = time.time()
    data = {"message": {"message": message, "extraInfo": {
        "py_callstack": stack, "timestamp": str(int(now)), "paratrain_time": repr(now)}}}
    try:
        with open(path, "w") as f:
            json.dump(data, f)
    except OSError:
        return False
    return True


class OneLineErrors:
    """``sys.excepthook`` printing paratrain's own errors as one line.

    Args:
        previous: the hook it replaced, used for every other error.
        show_traceback: print whole tracebacks anyway (``PARATRAIN_TRACEBACK=1``).
        launched: ``paratrain launch`` started this process and reports errors itself.
    """

    def __init__(self, previous: Any, *, show_traceback: bool, launched: bool) -> None:
        self.previous = previous
        self.show_traceback = show_traceback
        self.launched = launched

    def __call__(self, exc_type: type[BaseException], exc: BaseException,
                 tb: TracebackType | None) -> None:
        _reported.append(exc_type.__name__)
        one_line = is_one_line(exc) and not self.show_traceback
        message = summary(exc) if one_line else f"{exc_type.__name__}: {summary(exc)}"
        recorded = record_error_file(exc, message, with_traceback=not one_line, tb=tb)
        if recorded and self.launched:
            return  # `paratrain launch` prints the first failed rank's error, once
        if one_line:
            print(f"paratrain: {message}", file=sys.stderr, flush=True)
        else:
            self.previous(exc_type, exc, tb)


# Names of the uncaught errors this process reported: a process that ends after one
# ended by an error, not by finishing its script (see paratrain.run.collective_calls).
_reported: list[str] = []


def error_reported() -> bool:
    """True once an uncaught error went through the hook (this process is failing)."""
    return bool(_reported)


def install_excepthook(*, show_traceback: bool = False, launched: bool = False) -> None:
    """Make uncaught paratrain errors one line; a second call updates the options."""
    hook = sys.excepthook
    if isinstance(hook, OneLineErrors):
        hook.show_traceback, hook.launched = show_traceback, launched
    else:
        sys.excepthook = OneLineErrors(hook, show_traceback=show_traceback, launched=launched)
