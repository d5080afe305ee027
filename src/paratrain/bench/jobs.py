"""Start one bench configuration through the real launcher, wait with a deadline, read results.

Shared by ``paratrain bench`` (local jobs) and ``benchmarks/plan_validation.py`` (jobs
spread over network-namespace hosts, which build their own launcher command line).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from paratrain.strategies.table import strategy_entry

_LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


def worker_argv(spec_path: Path, out_dir: Path) -> list[str]:
    """The launcher's script part: ``-m paratrain.bench.worker --spec ... --out ...``."""
    return ["-m", "paratrain.bench.worker", "--spec", str(spec_path), "--out", str(out_dir)]


def server_args(strategy: str) -> tuple[int, list[str]]:
    """``(extra processes, launcher flags)`` for ``strategy`` (0 and none for most), from
    the strategy table; ValueError for an unknown name. A layout row (``cp=2``) has none."""
    if "=" in strategy:
        return 0, []
    entry = strategy_entry(strategy)
    count = entry.server_processes
    return count, ([entry.server_flag, str(count)] if count else [])


def local_launch_argv(spec_path: Path, out_dir: Path, *, strategy: str, world_size: int) -> list[str]:
    """``python -m paratrain.cli launch --nproc-per-node N [...] -m paratrain.bench.worker``."""
    servers, flags = server_args(strategy)
    return [sys.executable, "-m", "paratrain.cli", "launch",
            "--nproc-per-node", str(world_size + servers), *flags, *worker_argv(spec_path, out_dir)]


def job_env(*, threads: int | None = None, extra: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without launcher variables, with the working directory importable
    (so ``my_module:build`` resolves in the workers) and optional thread pinning."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env.update(extra or {})
    return env


def kill_tree(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """Stop ``proc`` and every descendant (torchrun's workers run in their own sessions)."""
    with suppress(psutil.Error):
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        for p in family:
            with suppress(psutil.Error):
                p.terminate()
        _, alive = psutil.wait_procs(family, timeout=grace)
        for p in alive:
            with suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(alive, timeout=5)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


@dataclass
class JobOutcome:
    """Per-rank results of one launched job, or why there are none."""

    results: list[dict[str, Any]] = field(default_factory=list)
    reason: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.results) and not self.reason


def wait_all(procs: Sequence[subprocess.Popen], timeout: float) -> str:
    """Wait for every process; on timeout or a failure kill the rest. Returns "" or why."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if time.monotonic() > deadline:
                return f"timed out after {timeout:.0f} s"
            if any(p.poll() not in (None, 0) for p in procs):
                time.sleep(2.0)  # let the others report their own error first
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p)
    failed = [p.returncode for p in procs if p.returncode != 0]
    return f"launcher exited with code {failed[0]}" if failed else ""


def collect(out_dir: Path, failure: str = "", log: str = "") -> JobOutcome:
    """Read ``rank*.json``; a worker's own error line beats the launcher's exit code."""
    errors = sorted(out_dir.glob("error-rank*.json"))
    if errors:
        return JobOutcome(reason=json.loads(errors[0].read_text())["reason"])
    results = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    if failure or not results:
        tail = [line for line in log.strip().splitlines() if line.strip()][-1:]
        why = failure or "no rank wrote a result"
        return JobOutcome(reason=f"{why}{': ' + tail[0] if tail else ''}")
    return JobOutcome(results=sorted(results, key=lambda r: r["rank"]))


def run_local(argv: list[str], out_dir: Path, *, env: dict[str, str], timeout: float) -> JobOutcome:
    """Run one local launcher command line and collect its results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "launcher.log"
    started = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        failure = wait_all([proc], timeout)
    outcome = collect(out_dir, failure, log_path.read_text(errors="replace"))
    outcome.seconds = time.monotonic() - started
    return outcome
