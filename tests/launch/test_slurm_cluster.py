"""A real Slurm (one node on loopback): USR1 -> checkpoint -> requeue -> exact resume.

``paratrain slurm --submit`` writes and submits the job; ``scancel --signal=USR1`` stands
for Slurm's ``--signal=USR1@90`` before the time limit (both reach every process of the
``srun`` step). The requeued job must resume from the checkpoint and end with the final
weights of an uninterrupted run, bitwise. Skipped with one line where munged, slurmctld
or slurmd cannot start (not installed, not root).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from paratrain.testing.slurm import SlurmCluster, SlurmUnavailable

TRAIN = str(Path(__file__).resolve().parents[1] / "scripts" / "fault_train.py")
# 200 samples / (8 x 2 ranks) = 13 steps per epoch, 39 in all; slow enough to be signalled.
ARGS = ["--epochs", "3", "--step-sleep", "0.2", "--log-steps"]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def _leftovers(conf: str) -> list[str]:
    """Processes (other than this one) started for the cluster at ``conf``."""
    found = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            if proc.pid != os.getpid() and proc.environ().get("SLURM_CONF") == conf:
                found.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:80]}")
        except psutil.Error:
            continue
    return found


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        cluster.stop()
        pytest.skip(f"Slurm cannot start here: {exc}")
    yield cluster
    cluster.stop()
    assert not _leftovers(cluster.env["SLURM_CONF"]), _leftovers(cluster.env["SLURM_CONF"])


def _launch_reference(tmp_path: Path) -> dict[str, torch.Tensor]:
    out = tmp_path / "reference.pt"
    subprocess.run([sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node", "2",
                    TRAIN, *ARGS, "--step-sleep", "0", "--out", str(out)], check=True,
                   capture_output=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return torch.load(out)


def _wait_for_step(log: Path, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and f"step {step} rank 0" in log.read_text():
            return
        time.sleep(0.2)
    raise TimeoutError(f"no 'step {step}' in {log} after {timeout_s:g} s")


def test_usr1_requeues_the_job_and_it_resumes_bitwise(cluster, tmp_path):
    expected = _launch_reference(tmp_path)
    log, out = tmp_path / "job.log", tmp_path / "final.pt"
    submitted = subprocess.run(
        [sys.executable, "-m", "paratrain.cli", "slurm", "--nproc-per-node", "2",
         "--write", str(tmp_path / "job.sbatch"), "--output", str(log), "--submit", "--",
         TRAIN, *ARGS, "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(out)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={**cluster.env, "OMP_NUM_THREADS": "1"})
    assert submitted.returncode == 0, submitted.stderr
    job = re.search(r"Submitted batch job (\d+)", submitted.stdout).group(1)
    _wait_for_step(log, 4, timeout_s=240)
    cluster.command("scancel", "--signal=USR1", job)
    info = cluster.wait(job, lambda i: i["JobState"] in TERMINAL, timeout_s=480)
    text = log.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, text[-3000:])
    saved = re.search(r"paratrain: SIGUSR1 received; saved step (\d+) to \S+; requeued Slurm "
                      rf"job {job}, exiting", text)
    assert saved, text[-3000:]
    assert re.search(rf"resumed from \S+step-0*{saved.group(1)}\.pt \(epoch \d, step "
                     rf"{saved.group(1)}\)", text), text[-3000:]
    got = torch.load(out)
    assert all(torch.equal(expected[name], got[name]) for name in expected)
