"""Preemption campaign on a real (one-node, loopback) Slurm: signal, requeue, exact resume.

Starts munged, slurmctld and slurmd (:class:`paratrain.testing.slurm.SlurmCluster`, needs
root and Debian's ``slurm-wlm`` + ``munge``), trains once without interruption through
``paratrain launch`` (2 processes), then submits the same training ``--jobs`` times with
``paratrain slurm --submit`` and sends each job USR1 (``scancel --signal=USR1``, what
``--signal=USR1@90`` sends before the time limit) at a random moment: after a random step,
plus a random fraction of a step (the jobs also save every 5 steps, so some signals land
next to a periodic save). Each job must save, requeue itself from rank 0, resume
from that checkpoint and end with the uninterrupted run's final weights, bitwise.

    python benchmarks/slurm_preemption.py                 # 5 jobs, seed 0
    python benchmarks/slurm_preemption.py --jobs 3 --seed 7
"""

from __future__ import annotations

import argparse
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from paratrain.testing.slurm import SlurmCluster, SlurmUnavailable

TRAIN = str(Path(__file__).resolve().parents[1] / "tests" / "scripts" / "fault_train.py")
STEPS = 39  # 200 samples / (8 x 2 ranks) = 13 steps per epoch, 3 epochs
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def train_args(step_sleep: float) -> list[str]:
    return [TRAIN, "--epochs", "3", "--step-sleep", str(step_sleep), "--log-steps"]


def reference(folder: Path) -> dict[str, torch.Tensor]:
    out = folder / "reference.pt"
    subprocess.run([sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node", "2",
                    *train_args(0.0), "--out", str(out)], check=True, capture_output=True,
                   timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return torch.load(out)


def wait_for(log: Path, pattern: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if log.exists() and re.search(pattern, log.read_text(), re.M):
            return
        time.sleep(0.05)
    raise TimeoutError(f"no {pattern!r} in {log} after {timeout_s:g} s")


def one_job(cluster: SlurmCluster, folder: Path, at_step: int, fraction: float,
            step_sleep: float, expected: dict[str, torch.Tensor]) -> dict[str, object]:
    log, out = folder / "job.log", folder / "final.pt"
    started = time.monotonic()
    submitted = subprocess.run(
        [sys.executable, "-m", "paratrain.cli", "slurm", "--nproc-per-node", "2",
         "--write", str(folder / "job.sbatch"), "--output", str(log), "--submit", "--",
         *train_args(step_sleep), "--checkpoint-dir", str(folder / "ckpt"),
         "--checkpoint-every", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=60, env={**cluster.env, "OMP_NUM_THREADS": "1"})
    job = re.search(r"Submitted batch job (\d+)", submitted.stdout).group(1)
    wait_for(log, rf"^step {at_step} rank 0$", timeout_s=600)
    time.sleep(fraction * step_sleep)
    cluster.command("scancel", "--signal=USR1", job)
    signalled = time.monotonic()
    info = cluster.wait(job, lambda i: i["JobState"] in TERMINAL, timeout_s=900)
    text = log.read_text()
    saved = re.search(r"SIGUSR1 received; saved step (\d+) to \S+; requeued Slurm job", text)
    resumed = re.search(r"resumed from \S+step-0*(\d+)\.pt", text)
    got = torch.load(out) if out.exists() else {}
    equal = bool(got) and all(torch.equal(expected[k], got[k]) for k in expected)
    return {"job": job, "signal after step": f"{at_step} + {fraction:.2f}",
            "saved step": saved.group(1) if saved else "-",
            "resumed from": resumed.group(1) if resumed else "-",
            "restarts": info.get("Restarts", "?"), "state": info["JobState"],
            "signal -> end (s)": f"{time.monotonic() - signalled:.0f}",
            "job total (s)": f"{time.monotonic() - started:.0f}",
            "final weights": "bitwise equal" if equal else "DIFFERENT"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--step-sleep", type=float, default=0.2,
                        help="seconds each step sleeps, so that there is time to signal")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="slurm-preemption-"))
    rows = []
    try:
        with SlurmCluster(root / "cluster") as cluster:
            expected = reference(root)
            for index in range(args.jobs):
                folder = root / f"job{index}"
                folder.mkdir()
                # Up to step STEPS - 3: the stop is agreed one step later, and a signal
                # after the last step would leave nothing to requeue.
                rows.append(one_job(cluster, folder, rng.randint(1, STEPS - 3), rng.random(),
                                    args.step_sleep, expected))
                print(" | ".join(str(v) for v in rows[-1].values()), file=sys.stderr, flush=True)
    except SlurmUnavailable as exc:
        print(f"slurm_preemption: Slurm cannot start here: {exc}", file=sys.stderr)
        return 2
    header = list(rows[0])
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(str(row[h]) for h in header) + " |")
    ok = all(r["final weights"] == "bitwise equal" and r["restarts"] == "1"
             and r["state"] == "COMPLETED" for r in rows)
    print(f"\n{sum(r['restarts'] == '1' for r in rows)}/{len(rows)} jobs requeued once and "
          f"resumed; {'all' if ok else 'NOT all'} final weights bitwise equal to the "
          "uninterrupted run")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
