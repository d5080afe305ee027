"""The rank side of the persistent test pool (see ``paratrain.testing.pool``).

A worker imports torch and paratrain once, then runs one shipped function per
task. Between tasks it puts back what a fresh interpreter would have: the
environment, working directory, signal handlers and exception hooks, logging and
warning state, torch's global settings and random streams, and it runs the
``atexit`` callbacks the task registered (a spawned process would have run them
when it exited). What it cannot put back (a thread still running, a process group
that would not close, a torch mode left on the stack, memory grown past a bound)
is reported, and the parent replaces the whole pool before the next task.
"""

from __future__ import annotations

import atexit
import gc
import io
import logging
import os
import queue
import random
import signal
import sys
import threading
import time
import traceback
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.distributed import _compat

# A worker whose resident memory grows past this is replaced: tests that build
# models leave caches (allocator arenas, imported model families) behind.
MAX_RSS_BYTES = 2 * 2**30
THREAD_GRACE_S = 2.0
_IDLE_IGNORED = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


@dataclass(frozen=True)
class Task:
    """One test's function, shipped to every rank of a pool."""

    task_id: int
    payload: bytes  # torch.save((fn, args)): unpickled after sys.path is set
    environ: dict[str, str]  # the whole environment the rank runs under
    cwd: str
    sys_path: list[str]
    stdout: str  # files the rank's fds 1 and 2 write to during the task
    stderr: str


def _torch_settings() -> dict[str, Any]:
    return {
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "deterministic_warn": torch.is_deterministic_algorithms_warn_only_enabled(),
        "threads": torch.get_num_threads(),
        "matmul": torch.get_float32_matmul_precision(),
        "anomaly": torch.is_anomaly_enabled(),
        "cudnn": (torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark),
    }


def _set_torch_settings(saved: dict[str, Any]) -> None:
    """Set back only what changed: some setters import heavy modules on first call."""
    now = _torch_settings()
    if now["dtype"] != saved["dtype"]:
        torch.set_default_dtype(saved["dtype"])
    if now["grad"] != saved["grad"]:
        torch.set_grad_enabled(saved["grad"])
    if (now["deterministic"], now["deterministic_warn"]) != (saved["deterministic"],
                                                             saved["deterministic_warn"]):
        torch.use_deterministic_algorithms(saved["deterministic"],
                                           warn_only=saved["deterministic_warn"])
    if now["threads"] != saved["threads"]:
        torch.set_num_threads(saved["threads"])
    if now["matmul"] != saved["matmul"]:
        torch.set_float32_matmul_precision(saved["matmul"])
    if now["anomaly"] != saved["anomaly"]:
        torch.autograd.set_detect_anomaly(saved["anomaly"])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved["cudnn"]


def _logger_states() -> dict[str, tuple]:
    loggers = [logging.root, *(logging.getLogger(name)
                               for name in list(logging.Logger.manager.loggerDict))]
    return {lg.name: (list(lg.handlers), lg.level, lg.propagate, lg.disabled)
            for lg in loggers if isinstance(lg, logging.Logger)}


class _TaskExitHooks:
    """``atexit.register`` during a task: callbacks run when the task ends."""

    def __init__(self) -> None:
        self.callbacks: list[tuple] = []
        self._register, self._unregister = atexit.register, atexit.unregister

    def register(self, func, *args, **kwargs):
        self.callbacks.append((func, args, kwargs))
        return func

    def unregister(self, func) -> None:
        self.callbacks = [c for c in self.callbacks if c[0] != func]

    @contextmanager
    def installed(self):
        atexit.register, atexit.unregister = self.register, self.unregister
        try:
            yield
        finally:
            atexit.register, atexit.unregister = self._register, self._unregister
            for func, args, kwargs in reversed(self.callbacks):
                try:
                    func(*args, **kwargs)
                except BaseException:  # noqa: BLE001 - as at exit: printed, not raised
                    traceback.print_exc()


class Baseline:
    """What this interpreter looked like before any task ran, and how to get back to it."""

    def __init__(self) -> None:
        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        self.sys_path = list(sys.path)
        self.argv = list(sys.argv)
        self.signals = {s: signal.getsignal(s) for s in signal.valid_signals()
                        if s not in (signal.SIGKILL, signal.SIGSTOP)}
        self.hooks = (sys.excepthook, threading.excepthook, sys.displayhook)
        self.torch = _torch_settings()
        self.loggers = _logger_states()
        self.warning_filters = list(warnings.filters)
        self.threads = {t.ident for t in threading.enumerate()}
        self.collected = False  # garbage collected since the task ended

    def idle(self) -> None:
        """Between tasks: a signal meant for the parent's other children (a test of
        signal forwarding sends one to every child) must not end the worker."""
        for sig in _IDLE_IGNORED:
            signal.signal(sig, signal.SIG_IGN)

    def start_task(self, *, reseed: bool) -> None:
        """Signal handlers, and random streams seeded from the OS, as in a fresh process."""
        for sig in _IDLE_IGNORED:
            signal.signal(sig, self.signals[sig])
        if not reseed:
            return
        torch.seed()
        random.seed()
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()

    def restore(self) -> list[str]:
        """Put everything back; return what could not be, which retires the pool."""
        problems = []
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        sys.path[:] = self.sys_path
        sys.argv[:] = self.argv
        for sig, handler in self.signals.items():
            if signal.getsignal(sig) is not handler and handler is not None:
                signal.signal(sig, handler)
        sys.excepthook, threading.excepthook, sys.displayhook = self.hooks
        _set_torch_settings(self.torch)
        self._restore_logging()
        warnings.filters[:] = self.warning_filters
        warnings.filterwarnings("default", message="\x00")  # bumps the filters' version,
        warnings.filters.pop(0)  # so "once" warnings of the last task show again
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()
        _clear_caches()
        if not self.collected:  # what the task left in cycles goes now, not in the next
            gc.collect()
        self.collected = False
        problems += self._leftovers()
        return problems

    def _restore_logging(self) -> None:
        saved = self.loggers
        for name in _logger_states():
            lg = logging.root if name == "root" else logging.getLogger(name)
            handlers, level, propagate, disabled = saved.get(name, ([], logging.NOTSET,
                                                                    True, False))
            lg.handlers[:] = handlers
            lg.setLevel(level)
            lg.propagate, lg.disabled = propagate, disabled

    def _leftovers(self) -> list[str]:
        import torch.distributed as dist

        problems = []
        if dist.is_available() and dist.is_initialized():
            problems.append("a process group is still initialized")
        deadline = time.monotonic() + THREAD_GRACE_S
        while True:
            extra = [t for t in threading.enumerate()
                     if t.ident not in self.threads and t.is_alive()]
            if not extra or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if extra:
            problems.append("threads left running: " + ", ".join(t.name for t in extra))
        if _compat.torch_modes_active():
            problems.append("a torch function mode or autocast left on")
        rss = _rss_bytes()
        if rss > MAX_RSS_BYTES:
            problems.append(f"resident memory {rss / 2**30:.1f} GiB")
        return problems


def _clear_caches() -> None:
    """Empty torch.distributed's and paratrain's memoised functions: DTensor's sharding
    and redistribution caches hold meshes whose process groups the task destroyed."""
    with warnings.catch_warnings():  # getattr on deprecated names warns
        warnings.simplefilter("ignore")
        _clear_memoised()
    _compat.clear_dtensor_caches()


def _clear_memoised() -> None:
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith(("torch.distributed", "paratrain")):
            continue
        for value in list(vars(module).values()):
            members = vars(value).values() if isinstance(value, type) else (value,)
            for member in list(members):
                if callable(getattr(member, "cache_clear", None)):
                    member.cache_clear()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def _redirected(stdout: str, stderr: str):
    """fds 1 and 2 (so also C code and subprocesses) into the task's files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(stdout, "wb") as out, open(stderr, "wb") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])


def _run_task(task: Task, rank: int, world_size: int, isolate: bool,
              baseline: Baseline) -> tuple[bool, Any]:
    if isolate:
        os.environ.clear()
    baseline.start_task(reseed=isolate)
    os.environ.update(task.environ)
    os.chdir(task.cwd)
    sys.path[:] = task.sys_path
    hooks = _TaskExitHooks()
    try:
        with hooks.installed():
            try:
                fn, args = torch.load(io.BytesIO(task.payload), weights_only=False)
                value = fn(rank, world_size, *args)
                buffer = io.BytesIO()
                torch.save(value, buffer)
                return True, buffer.getvalue()
            except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
                return False, traceback.format_exc()
    finally:
        if isolate:
            import torch.distributed as dist

            from paratrain.distributed.process_group import destroy_process_group

            # destroy_process_group collects garbage first when there is a group.
            baseline.collected = dist.is_available() and dist.is_initialized()
            destroy_process_group()


def serve(rank: int, world_size: int, tasks: Any, results: Any, isolate: bool,
          parent_pid: int) -> None:
    """A pool worker's life: import once, then run tasks until told to stop."""
    import paratrain  # noqa: F401 - imported once for every task

    results.put(("ready", rank, os.getpid()))  # starts the queue's feeder thread,
    baseline = Baseline()  # which the baseline counts as the worker's own
    baseline.idle()
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent_pid:  # the parent is gone: no orphans
                return
            continue
        if task is None:
            return
        with _redirected(task.stdout, task.stderr):
            ok, value = _run_task(task, rank, world_size, isolate, baseline)
            problems = baseline.restore() if isolate else []
        baseline.idle()
        results.put((task.task_id, rank, ok, value, problems, _rss_bytes()))
