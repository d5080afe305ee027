"""One live run per checkpoint_dir: a second one is refused in one line naming the holder;
a lock left by a run that is gone (SIGKILL) is taken over with a notice; the same job
restarted (torchrun's restarts, a Slurm requeue) takes it over quietly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.checkpoint import lock as dirlock
from paratrain.checkpoint.lock import LOCK_NAME, CheckpointDirInUse, acquire
from paratrain.testing.pool import spawn

TRAIN = str(Path(__file__).resolve().parents[1] / "scripts" / "fault_train.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(directory: Path, *extra: str) -> list[str]:
    return [sys.executable, TRAIN, "--checkpoint-dir", str(directory), "--checkpoint-every",
            "2", *extra]


def in_use(directory: Path, pid: int) -> str:
    return (f"checkpoint_dir {str(directory)!r} is in use by another run (host "
            f"{socket.gethostname()}, pid {pid}, since ")


@pytest.mark.slow
def test_a_second_run_is_refused_and_a_killed_runs_lock_is_taken_over(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = subprocess.Popen(train(ckpt, "--step-sleep", "0.5", "--log-steps"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
    try:
        for line in first.stdout:
            if line.startswith("step 2 "):
                break
        second = subprocess.run(train(ckpt), capture_output=True, text=True, timeout=180, env=ENV)
        assert second.returncode == 1 and first.poll() is None, second.stderr[-3000:]
        lines = second.stderr.splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"paratrain: {in_use(ckpt, first.pid)}")
        assert lines[0].endswith("); two runs would resume from and overwrite each other's "
                                 "checkpoints: wait for it to end or pass another checkpoint_dir "
                                 f"(if that run is gone, delete {ckpt / LOCK_NAME})"), lines[0]
        assert "resumed from" not in second.stdout
        first.send_signal(signal.SIGKILL)  # leaves its lock file behind
        first.wait(timeout=30)
    finally:
        first.kill()
    assert (ckpt / LOCK_NAME).exists()
    third = subprocess.run(train(ckpt), capture_output=True, text=True, timeout=180, env=ENV)
    assert third.returncode == 0, third.stderr[-3000:]
    notice = [line for line in third.stdout.splitlines() if "notice" in line]
    assert len(notice) == 1 and notice[0].startswith(
        f"paratrain: notice: checkpoint_dir {str(ckpt)!r} was locked by a run that ended "
        f"without releasing it (host {socket.gethostname()}, pid {first.pid}, since ")
    assert notice[0].endswith("; its process is gone); taking it over")
    assert "resumed from" in third.stdout and not (ckpt / LOCK_NAME).exists()


def refused_worker(rank: int, world_size: int, directory: str) -> str | None:
    import paratrain

    try:
        paratrain.Run(accelerator="cpu", progress=False, checkpoint_dir=directory).close()
    except CheckpointDirInUse as exc:
        return str(exc)
    return None


def test_every_rank_refuses_a_directory_in_use(tmp_path):
    held, _ = acquire(tmp_path)  # this process: a live run on this host
    try:
        refused = spawn(refused_worker, 2, str(tmp_path), timeout=180)
    finally:
        held.release()
    assert refused[0] == refused[1] and refused[0].startswith(in_use(tmp_path, os.getpid()))
    assert not (tmp_path / LOCK_NAME).exists()


def write_holder(directory: Path, *, host: str, job: str | None, age_s: float = 0) -> None:
    path = directory / LOCK_NAME
    path.write_text(json.dumps({"host": host, "pid": 4242, "job": job, "since": "then"}))
    os.utime(path, (time.time() - age_s,) * 2)


def test_locks_from_other_hosts_and_restarts(tmp_path, monkeypatch):
    # Another host, another job, refreshed recently: it may be alive.
    write_holder(tmp_path, host="node-7", job="slurm:1")
    with pytest.raises(CheckpointDirInUse, match=r"in use by another run \(host node-7, pid 4242"):
        acquire(tmp_path, job="slurm:2")
    # The same job (a Slurm requeue lands on another node): taken over quietly.
    lock, notice = acquire(tmp_path, job="slurm:1")
    assert notice is None and json.loads((tmp_path / LOCK_NAME).read_text())["job"] == "slurm:1"
    lock.release()
    # Not refreshed for longer than STALE_AFTER_S: its run is gone.
    write_holder(tmp_path, host="node-7", job=None, age_s=dirlock.STALE_AFTER_S + 60)
    lock, notice = acquire(tmp_path)
    assert notice.endswith("(host node-7, pid 4242, since then; not refreshed for 180 s); "
                           "taking it over")
    lock.release()
    # This host, a dead pid, a torchrun restart of the same job: quietly.
    write_holder(tmp_path, host=socket.gethostname(), job="torchrun:abc")
    lock, notice = acquire(tmp_path, job="torchrun:abc")
    assert notice is None
    lock.release()
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun's restarted worker
    write_holder(tmp_path, host=socket.gethostname(), job=None)
    lock, notice = acquire(tmp_path)
    assert notice is None
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()
    assert dirlock.job_of({"SLURM_JOB_ID": "9", "TORCHELASTIC_RUN_ID": "x"}) == "slurm:9"
    assert dirlock.job_of({"TORCHELASTIC_RUN_ID": "none"}) is None


def test_without_flock_the_record_decides(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")  # Lustre without -o flock

    monkeypatch.setattr(fcntl, "flock", no_flock)
    path = tmp_path / LOCK_NAME
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "since": "x"}))
    with pytest.raises(CheckpointDirInUse, match=f"pid {os.getpid()}, since x"):
        acquire(tmp_path)  # a live process of this host holds it
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    path.write_text(json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout),
                                "since": "y"}))
    lock, notice = acquire(tmp_path)
    assert notice.endswith("since y; its process is gone); taking it over")
    lock.release()
