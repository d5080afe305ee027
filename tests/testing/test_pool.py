"""The persistent rank pool: same results as spawning, each test isolated from the last.

Every isolation check runs a leaking task, then a task that looks for the leak, on a
pool with isolation on (the leak is gone) and on one with it off (the leak is seen):
the second half proves that the check can fail.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from paratrain.distributed import spawn as fresh
from paratrain.distributed.spawn import WorkerFailed
from paratrain.testing import pool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def leaky():
    """A two-rank pool with isolation off, private to this module."""
    runner = pool.RankPool(2, {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"},
                           isolate=False)
    yield runner
    runner.close()


def _leaky_run(runner, fn, *args):
    return runner.run(fn, args, {**os.environ, **fresh.launch_environment(2)}, timeout=60)


def _pair(leak, look, runner=None):
    """``leak`` then ``look`` on the session's pool, or on ``runner``."""
    if runner is None:
        pool.spawn(leak, 2)
        return pool.spawn(look, 2)
    _leaky_run(runner, leak)
    return _leaky_run(runner, look)


def _all_reduce(rank, world_size, value):
    dist.init_process_group("gloo")
    tensor = torch.tensor([float(value + rank)])
    dist.all_reduce(tensor)
    return tensor.item(), os.environ["RANK"], os.environ["WORLD_SIZE"], os.getpid()


def _set_variable(rank, world_size):
    os.environ["POOL_LEAKED_VARIABLE"] = "1"


def _read_variable(rank, world_size):
    return os.environ.get("POOL_LEAKED_VARIABLE")


def _open_group(rank, world_size):
    dist.init_process_group("gloo")


def _group_open(rank, world_size):
    return dist.is_initialized()


def _change_torch(rank, world_size):
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    signal.signal(signal.SIGALRM, signal.SIG_IGN)


def _torch_state(rank, world_size):
    return (torch.get_default_dtype(), torch.is_grad_enabled(), torch.initial_seed(),
            signal.getsignal(signal.SIGALRM))


def _start_thread(rank, world_size):
    threading.Thread(target=time.sleep, args=(20,), name="leaked-by-test", daemon=True).start()


def _thread_names(rank, world_size):
    return [t.name for t in threading.enumerate()]


def _die_on_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)
    return rank


def _hang_on_rank_0(rank, world_size):
    if rank == 0:
        time.sleep(600)
    return rank


def _fail_before_collective(rank, world_size):
    dist.init_process_group("gloo")
    if rank == 0:
        raise ValueError("rank 0 fails before the all-reduce")
    dist.all_reduce(torch.ones(1))  # rank 1 waits here for a rank that never comes


def test_results_by_rank_and_a_new_group_per_call():
    first = pool.spawn(_all_reduce, 2, 1)
    second = pool.spawn(_all_reduce, 2, 10)
    assert [r[:3] for r in first] == [(3.0, "0", "2"), (3.0, "1", "2")]
    assert [r[0] for r in second] == [21.0, 21.0]
    assert {r[3] for r in first} == {r[3] for r in second}  # the same processes, reused


def test_a_raising_rank_reports_its_traceback():
    with pytest.raises(WorkerFailed, match="(?s)rank 0 raised.*ValueError: rank 0 fails"):
        pool.spawn(_fail_before_collective, 2, timeout=60)
    assert pool.spawn(_all_reduce, 2, 0)[0][0] == 1.0  # the broken group is not inherited


def _raise_on_rank_0(rank, world_size):
    if rank == 0:
        raise ValueError("only rank 0 fails")
    return os.getpid()


def test_a_failure_every_rank_survives_keeps_the_pool():
    before = {r[3] for r in pool.spawn(_all_reduce, 2, 0)}
    retired = len(pool.STATS["retired"])
    with pytest.raises(WorkerFailed, match="rank 0 raised"):
        pool.spawn(_raise_on_rank_0, 2)
    assert len(pool.STATS["retired"]) == retired
    assert {r[3] for r in pool.spawn(_all_reduce, 2, 0)} == before  # the same processes


def test_environment_is_reset(leaky):
    assert _pair(_set_variable, _read_variable) == [None, None]
    assert _pair(_set_variable, _read_variable, leaky) == ["1", "1"]


def test_process_group_is_destroyed(leaky):
    assert _pair(_open_group, _group_open) == [False, False]
    assert _pair(_open_group, _group_open, leaky) == [True, True]


def test_torch_settings_random_state_and_signals_are_reset(leaky):
    dtype, grad, seed, handler = _pair(_change_torch, _torch_state)[0]
    assert (dtype, grad, handler) == (torch.float32, True, signal.SIG_DFL)
    assert seed != 0
    assert _pair(_change_torch, _torch_state, leaky)[0] == (
        torch.float64, False, 0, signal.SIG_IGN)


def test_a_leftover_thread_retires_the_pool(leaky):
    retired = len(pool.STATS["retired"])
    names = _pair(_start_thread, _thread_names)[0]
    assert "leaked-by-test" not in names
    assert "threads left running: leaked-by-test" in pool.STATS["retired"][retired]
    assert "leaked-by-test" in _pair(_start_thread, _thread_names, leaky)[0]


def test_a_dead_worker_is_replaced():
    with pytest.raises(WorkerFailed, match="rank 1 died with exit code 3"):
        pool.spawn(_die_on_rank_1, 2, timeout=60)
    assert pool.spawn(_all_reduce, 2, 0)[1][0] == 1.0


def test_a_hang_names_the_test_and_rank_and_the_next_call_runs():
    with pytest.raises(WorkerFailed) as failed:
        pool.spawn(_hang_on_rank_0, 2, timeout=2)
    message = str(failed.value)
    assert "test_a_hang_names_the_test_and_rank" in message
    assert "timed out after 2 s waiting for ranks [0]" in message
    assert pool.spawn(_all_reduce, 2, 0)[0][0] == 1.0


def test_pool_overhead_against_spawning():
    """Per-call cost of a trivial two-rank task, measured side by side in one run."""
    pool.spawn(_all_reduce, 2, 0)  # the pool is warm, as for every test after the first
    start = time.perf_counter()
    fresh.spawn(_all_reduce, 2, 0)
    spawned = time.perf_counter() - start
    start = time.perf_counter()
    calls = 3
    for _ in range(calls):
        pool.spawn(_all_reduce, 2, 0)
    pooled = (time.perf_counter() - start) / calls
    print(f"two-rank call: spawn {spawned:.2f} s, pool {pooled:.3f} s, "
          f"{spawned / pooled:.1f}x")
    assert spawned / pooled > 3


def test_a_script_runs_unchanged_on_pool_ranks(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import os, sys\nimport torch.distributed as dist\n"
                      "dist.init_process_group('gloo')\n"
                      "print('rank', dist.get_rank(), 'of', dist.get_world_size(), sys.argv[1:])\n"
                      "sys.exit(3 if dist.get_rank() == 1 else 0)\n")
    first, second = pool.run_script(str(script), "--flag", "x")
    assert (first.returncode, first.stdout) == (0, "rank 0 of 2 ['--flag', 'x']\n")
    assert (second.returncode, second.stdout) == (3, "rank 1 of 2 ['--flag', 'x']\n")


def test_dead_worker_without_isolation_breaks_the_next_call(leaky):
    """Last in the module: it leaves the private pool broken."""
    with pytest.raises(WorkerFailed, match="rank 1 died"):
        _leaky_run(leaky, _die_on_rank_1)
    with pytest.raises(WorkerFailed, match="rank 1 died"):
        _leaky_run(leaky, _read_variable)


def _loader_with_workers(rank, world_size):
    from torch.utils.data import DataLoader

    return [batch.tolist() for batch in DataLoader(list(range(4)), batch_size=2,
                                                    num_workers=2)]


def test_a_task_may_start_processes_of_its_own():
    """DataLoader workers in a rank: a daemonic pool worker could not start them."""
    assert pool.spawn(_loader_with_workers, 1) == [[[0, 1], [2, 3]]]
