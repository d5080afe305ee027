"""The requeue signal (Slurm's ``--signal=USR1@90``): save, ``scontrol requeue`` from rank 0,
exit 0; the requeued job resumes exactly. Real Slurm: tests/launch/test_slurm_cluster.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paratrain.reliability import signals
from paratrain.reliability.signals import GracefulStop
from paratrain.settings import Settings

TRAIN = str(Path(__file__).resolve().parents[1] / "scripts" / "fault_train.py")


def _fake_scontrol(folder: Path, code: int = 0, message: str = "") -> Path:
    """A ``scontrol`` on PATH that records its arguments and exits with ``code``."""
    record = folder / "scontrol.calls"
    tool = folder / "scontrol"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {record}\necho "{message}" >&2\nexit {code}\n')
    tool.chmod(0o755)
    return record


def _stopped_by_usr1(**kwargs) -> GracefulStop:
    stop = GracefulStop(group=None, enabled=True, requeue_signal=signal.SIGUSR1, **kwargs)
    os.kill(os.getpid(), signal.SIGUSR1)  # would end pytest without the handler
    time.sleep(0.1)
    assert stop.should_stop() and stop.signal == signal.SIGUSR1
    return stop


def test_rank_0_requeues_the_slurm_job_and_exits_0(tmp_path, monkeypatch):
    record = _fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    before = signal.getsignal(signal.SIGUSR1)
    stop = _stopped_by_usr1(slurm_job_id="77", main=True)
    try:
        assert stop.after_save() == "; requeued Slurm job 77"
        assert stop.exit_code == 0
        assert record.read_text() == "requeue 77\n"
    finally:
        stop.close()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_other_ranks_leave_the_requeue_to_rank_0(tmp_path, monkeypatch):
    record = _fake_scontrol(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    stop = _stopped_by_usr1(slurm_job_id="77", main=False)
    try:
        assert (stop.after_save(), stop.exit_code) == ("", 0)
        assert not record.exists()
    finally:
        stop.close()


def test_a_failed_requeue_is_one_line_and_a_failing_exit(tmp_path, monkeypatch):
    _fake_scontrol(tmp_path, 1, "scontrol: error: Requested operation is presently disabled")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    stop = _stopped_by_usr1(slurm_job_id="77", main=True)
    try:
        assert stop.after_save() == (
            "; scontrol requeue 77 failed (scontrol: error: Requested operation is presently "
            "disabled); submit with sbatch --requeue")
        assert stop.exit_code == 128 + signal.SIGUSR1
    finally:
        stop.close()


def test_outside_slurm_the_signal_saves_and_exits_with_its_code():
    stop = _stopped_by_usr1(slurm_job_id=None)
    try:
        assert stop.after_save() == ("; not in a Slurm job (SLURM_JOB_ID unset), nothing to "
                                     "requeue")
        assert stop.exit_code == 128 + signal.SIGUSR1
    finally:
        stop.close()


def test_a_signal_held_since_start_up_stops_the_run():
    before = signal.getsignal(signal.SIGUSR1)
    signals.hold(signal.SIGUSR1)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # before Run(): the worker is still starting
        time.sleep(0.1)
        stop = GracefulStop(group=None, enabled=True, requeue_signal=signal.SIGUSR1)
        assert stop.should_stop() and stop.signal == signal.SIGUSR1
        stop.close()
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_the_requeue_signal_setting():
    assert Settings.from_environ({}).requeue_signal == signal.SIGUSR1
    assert Settings.from_environ({"PARATRAIN_REQUEUE_SIGNAL": "usr2"}).requeue_signal == 12
    assert Settings.from_environ({"PARATRAIN_REQUEUE_SIGNAL": "0"}).requeue_signal is None
    assert Settings.from_environ({"SLURM_JOB_ID": "5"}).slurm_job_id == "5"
    with pytest.raises(ValueError, match=r"^PARATRAIN_REQUEUE_SIGNAL='KILL' must name a "
                       r"catchable signal other than TERM/INT, e\.g\. USR1 or USR2 \(0 turns it "
                       r"off\)$"):
        Settings.from_environ({"PARATRAIN_REQUEUE_SIGNAL": "KILL"})


def _agreement_worker(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    stop = GracefulStop(group=dist.group.WORLD, enabled=True, requeue_signal=signal.SIGUSR1)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.1)
    stops = [stop.should_stop() for _ in range(2)]  # the flag is read one step later
    stop.close()
    dist.destroy_process_group()
    return f"{stops} {stop.signal.name}"


def test_the_ranks_agree_on_which_signal_stopped_them():
    from paratrain.testing.pool import spawn

    # Only rank 1 got USR1; rank 0 must stop the same way (requeue, not SIGTERM's 143).
    assert spawn(_agreement_worker, 2) == ["[False, True] SIGUSR1"] * 2


@pytest.mark.slow
def test_usr1_to_the_launcher_saves_requeues_and_the_job_resumes_exactly(tmp_path):
    """No Slurm daemons: a fake ``scontrol`` and ``SLURM_JOB_ID``; the launcher forwards.
    The signalled job is a real launch; the uninterrupted reference and the requeued run
    (the same script, resuming from the checkpoint) run on the rank pool."""
    from paratrain.testing.pool import run_script

    record = _fake_scontrol(tmp_path)
    slurm = {"OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "88",
             "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    args = ["--epochs", "3", "--checkpoint-dir", str(tmp_path / "ckpt")]
    launch = [sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node", "2", TRAIN,
              *args]
    job = subprocess.Popen([*launch, "--step-sleep", "0.2", "--log-steps"],
                           env={**os.environ, **slurm}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in job.stdout:
        lines.append(line)
        if line.startswith("step 3 rank"):
            job.send_signal(signal.SIGUSR1)
            break
    lines += job.stdout.readlines()
    assert job.wait(timeout=120) == 0, "".join(lines)[-3000:]
    saved = re.search(r"^paratrain: SIGUSR1 received; saved step (\d+) to \S+; requeued Slurm "
                      r"job 88, exiting$", "".join(lines), re.M)
    assert saved and record.read_text() == "requeue 88\n", "".join(lines)[-3000:]
    reference = run_script(TRAIN, *args[:2], "--out", str(tmp_path / "reference.pt"), env=slurm)
    assert all(r.returncode == 0 for r in reference), reference[0].stderr[-2000:]
    again = run_script(TRAIN, *args, "--out", str(tmp_path / "final.pt"), env=slurm)
    assert all(r.returncode == 0 for r in again), again[0].stderr[-2000:]
    assert f"(epoch 0, step {saved.group(1)})" in again[0].stdout, again[0].stdout + again[0].stderr
    expected, got = torch.load(tmp_path / "reference.pt"), torch.load(tmp_path / "final.pt")
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_the_launcher_passes_the_signal_to_its_workers_and_names_it(tmp_path, monkeypatch):
    from paratrain.launch.launcher import _stop_line

    monkeypatch.setattr(signals, "_forwarded", [])
    got = tmp_path / "got"
    child = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGUSR1, lambda s, f: (open({str(got)!r}, 'w').write(str(s)), "
        "sys.exit(0)))\nprint('ready', flush=True)\ntime.sleep(60)\n")], stdout=subprocess.PIPE,
        text=True)
    before = signal.getsignal(signal.SIGUSR1)
    try:
        assert child.stdout.readline() == "ready\n"
        signals.forward_to_children(signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # would end pytest without the handler
        assert child.wait(timeout=30) == 0 and got.read_text() == str(int(signal.SIGUSR1))
    finally:
        signal.signal(signal.SIGUSR1, before)
        child.kill()
    # Slurm's requeue then stops the launcher with SIGTERM: the line says why.
    assert _stop_line(signal.SIGTERM) == ("stopped by SIGTERM after SIGUSR1 (the job is being "
                                          "requeued)")


def test_a_second_signal_is_quiet(capfd):
    """Slurm signals every process of the step and the launcher forwards a copy: the second
    one used to hit the watchdog's closed pipe ('Exception ignored ... BrokenPipeError')."""
    stop = GracefulStop(group=None, enabled=True, grace_s=30, requeue_signal=signal.SIGUSR1)
    try:
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.3)  # the watchdog reads the first one in between
        assert stop.should_stop()
    finally:
        stop.close()
    assert "BrokenPipeError" not in capfd.readouterr().err
