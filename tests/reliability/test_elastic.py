"""``paratrain launch --max-restarts N``: a failed job restarts and resumes by itself.

torchrun's elastic agent restarts the workers; the restarted Run finds the
newest complete checkpoint and continues. With dropout and Adam, the final
parameters are bitwise those of an uninterrupted run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TRAIN = str(Path(__file__).resolve().parents[1] / "scripts" / "fault_train.py")
pytestmark = pytest.mark.slow


def launch(tmp_path: Path, name: str, *args: str, env: dict[str, str] | None = None,
           restarts: int = 0) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path / f"{name}.pt"
    result = subprocess.run(
        [sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node", "2",
         "--max-restarts", str(restarts), TRAIN, "--out", str(out), *args],
        capture_output=True, text=True, timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})
    return result, out


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    result, out = launch(tmp_path_factory.mktemp("full"), "full")
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


def assert_same(expected: dict[str, torch.Tensor], path: Path) -> None:
    got = torch.load(path)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_killed_worker_is_restarted_and_resumes_exactly(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    # 200 samples / (8 x 2) = 13 steps per epoch; rank 1 dies at step 10, last save at 8.
    result, out = launch(tmp_path, "restarted", "--checkpoint-dir", str(ckpt),
                         "--checkpoint-every", "4", restarts=1,
                         env={"PARATRAIN_KILL_AT_STEP": "10", "PARATRAIN_KILL_RANK": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "step-000000008.pt (epoch 0, step 8)" in result.stdout, result.stdout
    assert_same(uninterrupted, out)


def test_sigterm_saves_a_checkpoint_and_the_restart_resumes_from_it(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    # No periodic checkpoints: the only one is written because of SIGTERM. Rank 0 gets
    # it after step 6; the ranks agree one step later and both stop after step 7.
    result, out = launch(tmp_path, "terminated", "--checkpoint-dir", str(ckpt), restarts=1,
                         env={"PARATRAIN_TERM_AT_STEP": "6", "PARATRAIN_KILL_RANK": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "SIGTERM received; saved step 7" in result.stdout, result.stdout
    assert "step-000000007.pt (epoch 0, step 7)" in result.stdout, result.stdout
    assert_same(uninterrupted, out)

