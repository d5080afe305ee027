"""A collective ``Run`` method called on some ranks only ends with one line naming it."""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.distributed import spawn as fresh
from paratrain.distributed.spawn import WorkerFailed
from paratrain.reliability.health import HealthError
from paratrain.run import collective_calls
from paratrain.run.collective_calls import CollectiveCalls

ADVICE = ("run.prepare(), run.evaluate(), run.mean(), run.sum(), run.gather() and run.save() "
          "are collective: call them on every rank (only printing belongs under "
          "`if run.is_main`)")


def trained(run):
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = run.prepare(model, optimizer)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    run.backward(F.cross_entropy(model(x), y))
    run.step(optimizer)
    return model, (x, y)


def alone_on_rank_0(rank, world_size, method, directory):
    """Rank 0 calls ``method`` alone; the other ranks close their run and exit."""
    run = paratrain.Run(strategy="ddp", accelerator="cpu", progress=False, timeout_s=60,
                        checkpoint_dir=directory)
    model, batch = trained(run)
    if rank != 0:
        run.close()
        return "closed"
    calls = {"save": run.save, "evaluate": lambda: run.evaluate(model, [batch]),
             "gather": lambda: run.gather(1.0)}
    try:
        calls[method]()
    except HealthError as exc:
        return str(exc)
    finally:
        run.close()
    return "no error"


@pytest.mark.slow
@pytest.mark.parametrize("method", ["save", "evaluate", "gather"])  # mean: in the next test
def test_a_collective_method_on_rank_0_only_is_named(method, tmp_path):
    # Fresh processes, not the pool: rank 1's process must exit (it breaks rank 0's wait).
    results = fresh.spawn(alone_on_rank_0, 2, method, str(tmp_path), timeout=180)
    assert results[1] == "closed"
    assert results[0] == (f"rank 0 called run.{method}() but rank 1 did not (it called "
                          f"run.close()); {ADVICE}")


def peer_fails(rank, world_size):
    """Rank 1 raises inside its ``with Run()``: its close is no misuse, rank 0's error stays."""
    try:
        with paratrain.Run(strategy="ddp", accelerator="cpu", progress=False,
                           timeout_s=60) as run:
            trained(run)
            if rank == 1:
                raise ValueError("a bug on rank 1")
            run.mean(1.0)
    except ValueError:
        return "raised"
    except RuntimeError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


@pytest.mark.slow
def test_a_peer_that_failed_is_not_called_a_misuse():
    first, second = fresh.spawn(peer_fails, 2, timeout=180)  # rank 1's process must exit
    assert second == "raised"
    assert first.startswith("PeerLostError: rank 0: a collective failed") and "did not" not in first


def group_outlives_the_run(rank, world_size):
    """The script owns the group, so rank 1's close leaves it up: rank 0 would wait for the
    timeout (under NCCL be aborted by its watchdog) without the watcher."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    # Run's timeout sets the watcher's grace (half of it, at most 15 s), not the group's.
    run = paratrain.Run(strategy="ddp", accelerator="cpu", progress=False, timeout_s=20)
    trained(run)
    if rank == 0:
        started = time.monotonic()
        run.mean(1.0)  # never returns: the watcher ends the process
        return time.monotonic() - started
    run.close()
    time.sleep(60)
    return "slept"


@pytest.mark.slow
def test_a_collective_left_waiting_by_a_closed_peer_ends_in_seconds(capfd):
    started = time.monotonic()
    with pytest.raises(WorkerFailed, match="rank 0 died with exit code 1"):
        fresh.spawn(group_outlives_the_run, 2, timeout=100)  # a rank dies: not on the pool
    assert time.monotonic() - started < 60  # the collective's timeout is 120 s
    lines = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert lines[-1] == (f"paratrain: rank 0 called run.mean() but rank 1 did not (it called "
                         f"run.close()); {ADVICE}"), lines[-5:]


@pytest.mark.parametrize("ended, expected", [
    ({}, None),
    ({1: ("closed", 3)}, None),  # it made this call too, then closed: not this call's fault
    ({1: ("closed", 2)}, "rank 0 called run.save() but rank 1 did not (it called run.close())"),
    ({1: ("finished", 2), 2: ("closed", 1), 3: ("closed", 3)},
     "rank 0 called run.save() but ranks 1, 2 did not (they called run.close() or finished "
     "without run.close())"),
])
def test_diagnosis_counts_the_calls_each_peer_made(monkeypatch, ended, expected):
    calls = CollectiveCalls(rank=0, world_size=4, timeout_s=60)
    calls.announce("closed")  # no store here: nothing is written; stops the exit hook
    calls.count, calls.current = 3, "save"
    monkeypatch.setattr(collective_calls, "_store_call", lambda fn: ended)
    line = calls.diagnose()
    assert line == (None if expected is None else f"{expected}; {ADVICE}")


def test_a_single_process_run_counts_nothing():
    with paratrain.Run(accelerator="cpu", progress=False) as run:
        run.mean(1.0)
        assert run.__dict__["_collective_calls"] is None


@pytest.mark.slow
def test_under_the_launcher_the_job_ends_with_the_line(tmp_path):
    # The case: `if run.is_main: run.evaluate(...)`, the other rank finishing its
    # script without run.close(); it used to end in SIGABRT or gloo's traceback.
    script = Path(__file__).resolve().parents[1] / "scripts" / "rank0_only.py"
    started = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node", "2", str(script),
         "--method", "evaluate"], capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode != 0 and time.monotonic() - started < 120, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    # "(1 other worker(s) also failed)" may stand between: the agent stops rank 1 at exit.
    assert last.startswith("paratrain launch: worker rank 0 (local rank 0) failed first with "
                           "exit code 1"), out.stderr[-3000:]
    assert last.endswith(": rank 0 called run.evaluate() but rank 1 did not (it finished "
                         f"without run.close()); {ADVICE}"), out.stderr[-3000:]
