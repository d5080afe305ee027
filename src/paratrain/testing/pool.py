"""A persistent pool of gloo ranks for tests: ``spawn`` without starting interpreters.

``paratrain.distributed.spawn.spawn`` starts ``world_size`` fresh interpreters per
call, and each imports torch (2-4 s on two cores) before any rank computes. This
module's ``spawn`` has the same signature and the same results, but runs the
function on workers that live for the whole test session, one pool per world size
(PyTorch's ``MultiProcContinuousTest`` does the same for its own suite).

Each call is isolated from the last:
- the ranks run under the caller's environment as it is now, with the launcher
  variables ``spawn`` sets (a new ``MASTER_PORT``, so a new process group), in the
  caller's working directory and ``sys.path``;
- before the call the worker's random streams are those of a fresh process; after
  it the worker's process group is destroyed and its environment, hooks, signal
  handlers, logging, warnings and torch settings are put back
  (``worker_loop.Baseline``);
- a call that hangs, kills a worker or leaves something that cannot be put back (a
  running thread, an open group) retires the pool: the next call starts a new one, so
  it is unaffected; a rank that raises gives its peers ``FAILURE_GRACE_S`` to answer
  too, and the pool is kept only if all of them did;
- a timeout names the test and the ranks that did not answer, with their output.

Variables read when torch starts (``START_VARIABLES``) are fixed per pool: a call
that changes one gets a pool of its own. ``accelerator="cuda"`` calls go to the
real ``spawn``.

Example:
    >>> from paratrain.testing.pool import spawn                       # doctest: +SKIP
    >>> spawn(worker, 2, "arg")                                        # doctest: +SKIP
"""

from __future__ import annotations

import atexit
import contextlib
import io
import itertools
import os
import queue
import runpy
import shutil
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.multiprocessing as mp

from paratrain.distributed import spawn as fresh
from paratrain.distributed.spawn import WorkerFailed
from paratrain.testing import worker_loop

START_VARIABLES = ("CUDA_VISIBLE_DEVICES", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS",
                   "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OPENBLAS_CORETYPE",
                   "OPENBLAS_L2_SIZE", "PYTHONHASHSEED", "TORCH_LOGS")
# Across pools; past it the least recently used pool is closed. 1+2+3+4+8 ranks fit, so
# the suite's usual world sizes do not evict each other (each restart costs seconds).
MAX_WORKERS = 18
READY_TIMEOUT_S = 180.0
# After one rank raised, how long its peers get to finish before the pool is replaced.
FAILURE_GRACE_S = 5.0
_TASK_IDS = itertools.count()


class RankPool:
    """``world_size`` long-lived rank processes started under ``start_env``.

    ``isolate=False`` switches every reset off (the pool's own tests use it to see
    that each reset matters): the worker keeps whatever the last task left, and a
    failed task does not retire the pool.
    """

    def __init__(self, world_size: int, start_env: dict[str, str], *,
                 isolate: bool = True) -> None:
        self.world_size = world_size
        self.isolate = isolate
        self.retired: str | None = None  # why this pool must not run another task
        self._outdir = tempfile.mkdtemp(prefix="paratrain-pool-")
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        # Not daemons: code under test may start processes of its own (DataLoader
        # workers, spawned ranks), which a daemon may not. close_pools ends them at exit.
        self._procs = [ctx.Process(target=worker_loop.serve, daemon=False,
                                   args=(rank, world_size, self._inboxes[rank],
                                         self._results, isolate, os.getpid()))
                       for rank in range(world_size)]
        with fresh.environment_at_start(start_env):
            for proc in self._procs:
                proc.start()
        ready: set[int] = set()
        deadline = time.monotonic() + READY_TIMEOUT_S
        while len(ready) < world_size:
            message = self._next_message(deadline, ready, "starting the pool")
            if message[0] == "ready":
                ready.add(message[1])

    def run(self, fn: Callable[..., Any], args: tuple, environ: dict[str, str],
            timeout: float) -> list[Any]:
        """Run ``fn(rank, world_size, *args)`` on every rank; results by rank."""
        task_id = next(_TASK_IDS)
        buffer = io.BytesIO()
        torch.save((fn, args), buffer)
        files = [(os.path.join(self._outdir, f"{task_id}-{r}.out"),
                  os.path.join(self._outdir, f"{task_id}-{r}.err"))
                 for r in range(self.world_size)]
        for rank, inbox in enumerate(self._inboxes):
            inbox.put(worker_loop.Task(
                task_id=task_id, payload=buffer.getvalue(),
                environ={**environ, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                cwd=os.getcwd(), sys_path=list(sys.path), stdout=files[rank][0],
                stderr=files[rank][1]))
        collected: dict[int, Any] = {}
        answered: set[int] = set()
        failure: str | None = None
        try:
            deadline = time.monotonic() + timeout
            while len(answered) < self.world_size:
                message = self._next_message(deadline, answered, _test_name(),
                                             files=files, timeout=timeout)
                if message[0] != task_id:
                    continue  # a late answer to an earlier, abandoned task
                _, rank, ok, value, problems, rss = message
                answered.add(rank)
                STATS["max_rss"] = max(STATS["max_rss"], rss)
                if problems:
                    self._retire(f"rank {rank}: " + "; ".join(problems))
                if ok:
                    collected[rank] = torch.load(io.BytesIO(value), weights_only=False)
                elif failure is None:
                    failure = f"rank {rank} raised:\n{value}"
                    if not self.isolate:
                        raise WorkerFailed(failure)
                    # The others may wait in a collective for this rank: give them a
                    # moment to fail or finish too; whoever does not retires the pool.
                    deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        except WorkerFailed:
            if failure is not None:  # a peer of the failed rank never answered
                self._retire("a rank raised and a peer did not finish")
                raise WorkerFailed(failure) from None
            self._retire("a task did not finish cleanly")
            raise
        except BaseException:
            self._retire("a task did not finish cleanly")  # a rank may be mid-collective
            raise
        finally:
            _forward_output(files)
        if failure is not None:
            raise WorkerFailed(failure)
        return [collected[r] for r in range(self.world_size)]

    def _next_message(self, deadline: float, answered: Any, what: str, *,
                      files: list | None = None, timeout: float | None = None) -> tuple:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                waiting = sorted(set(range(self.world_size)) - set(answered))
                limit = f" after {timeout:.0f} s" if timeout else ""
                raise WorkerFailed(f"{what}: timed out{limit} waiting for ranks {waiting}"
                                   + _output_tails(files, waiting))
            try:
                return self._results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs)
                        if p.exitcode is not None and r not in answered]
                if dead:
                    self._retire(f"rank {dead[0]} died")
                    raise WorkerFailed(f"{what}: rank {dead[0]} died with exit code "
                                       f"{self._procs[dead[0]].exitcode}"
                                       + _output_tails(files, dead)) from None

    def _retire(self, reason: str) -> None:
        if self.isolate and self.retired is None:
            self.retired = f"{_test_name()}: {reason}"

    def stop(self) -> None:
        """Ask every worker to end after its task (``close`` waits for them)."""
        for proc, inbox in zip(self._procs, self._inboxes):
            if proc.is_alive() and self.retired is None:
                inbox.put(None)

    def close(self) -> None:
        """Stop every worker (killing any that does not stop) and remove its files."""
        self.stop()
        for proc in self._procs:
            proc.join(timeout=5 if self.retired is None else 0)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
        for handle in (self._results, *self._inboxes):
            handle.cancel_join_thread()
            handle.close()
        shutil.rmtree(self._outdir, ignore_errors=True)


def _test_name() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "spawn").split(" (")[0]


def _forward_output(files: list[tuple[str, str]]) -> None:
    """Each rank's output to this process's sys.stdout/stderr, where pytest captures it."""
    for out, err in files:
        for path, stream in ((out, sys.stdout), (err, sys.stderr)):
            try:
                with open(path, errors="replace") as handle:
                    text = handle.read()
                os.remove(path)
            except FileNotFoundError:
                continue
            if text:
                stream.write(text)
                stream.flush()


def _output_tails(files: list | None, ranks: list[int], chars: int = 2000) -> str:
    tails = []
    for rank in ranks if files else ():
        try:
            with open(files[rank][1], errors="replace") as handle:
                text = handle.read()[-chars:]
        except FileNotFoundError:
            continue
        if text.strip():
            tails.append(f"\n--- rank {rank} stderr (last {chars} chars) ---\n{text}")
    return "".join(tails)


_POOLS: OrderedDict[tuple, RankPool] = OrderedDict()
STATS = {"tasks": 0, "pools_started": 0, "retired": [], "max_rss": 0}


def _pool_for(world_size: int, start_env: dict[str, str]) -> RankPool:
    key = (world_size, *sorted(start_env.items()))
    pool = _POOLS.get(key)
    if pool is not None and pool.retired is None:
        _POOLS.move_to_end(key)
        return pool
    if pool is not None:
        STATS["retired"].append(pool.retired)
        _POOLS.pop(key).close()
    while _POOLS and sum(p.world_size for p in _POOLS.values()) + world_size > MAX_WORKERS:
        _POOLS.popitem(last=False)[1].close()
    _POOLS[key] = pool = RankPool(world_size, start_env)
    STATS["pools_started"] += 1
    return pool


def close_pools() -> None:
    """Stop every pool (the test session's end; also registered at exit). All are told
    first, so their workers shut their interpreters down side by side."""
    for pool in _POOLS.values():
        pool.stop()
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(close_pools)  # before multiprocessing joins its non-daemon children


@dataclass(frozen=True)
class ScriptRun:
    """One rank's end of :func:`run_script`: as ``subprocess.run`` would report it."""

    returncode: int
    stdout: str
    stderr: str


def _script_rank(rank: int, world_size: int, target: str, argv: list[str],
                 module: bool) -> ScriptRun:
    """Run a script (or ``-m`` module) as ``__main__`` in this rank, as its worker would."""
    out, err = io.StringIO(), io.StringIO()
    sys.argv[:] = [target, *argv]
    if not module:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)))
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            if not isinstance(stop.code, (int, type(None))):
                print(stop.code, file=sys.stderr)
        except BaseException:  # noqa: BLE001 - reported as the interpreter would
            traceback.print_exc()
            code = 1
    return ScriptRun(code, out.getvalue(), err.getvalue())


def run_script(target: str, *argv: str, nproc: int = 2, module: bool = False,
               env: dict[str, str] | None = None, timeout: float = 300.0) -> list[ScriptRun]:
    """Run a training script unchanged on ``nproc`` pool ranks, with the environment
    ``paratrain launch --nproc-per-node nproc`` gives it; each rank's exit code and output.

    For tests of what a script computes; a test of the launcher itself (its flags, its
    exit line, signals, restarts) starts ``paratrain launch``.

    Example:
        >>> run_script("examples/gpt_shakespeare.py", "--steps", "2")   # doctest: +SKIP
    """
    return spawn(_script_rank, nproc, str(target), list(argv), module, timeout=timeout,
                 env=env)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
          env: dict[str, str] | None = None, accelerator: str = "cpu") -> list[Any]:
    """``paratrain.distributed.spawn.spawn`` on the persistent pool (module docstring)."""
    if accelerator != "cpu":
        return fresh.spawn(fn, world_size, *args, timeout=timeout, env=env,
                           accelerator=accelerator)
    environ = {**os.environ, **fresh.launch_environment(world_size, accelerator), **(env or {})}
    start_env = {name: environ[name] for name in START_VARIABLES if name in environ}
    pool = _pool_for(world_size, start_env)
    STATS["tasks"] += 1
    return pool.run(fn, args, environ, timeout)
