"""A full or read-only checkpoint directory ends the run with one line naming the
checkpoint, the directory and the fix; the previous checkpoint stays intact and no
half-written file or shard directory is left under a checkpoint's name.

Real file systems, not mocks: a tmpfs too small for a second checkpoint, and one
remounted read-only mid-run (root ignores permission bits, not a read-only mount).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from paratrain.checkpoint.resume import OK, inspect

TRAIN = str(Path(__file__).resolve().parents[1] / "scripts" / "fault_train.py")
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None,
                                reason="mounts a tmpfs: needs root")


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                   check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def command(directory: Path, *, strategy: str, hidden: int, extra: tuple = ()) -> list[str]:
    return [sys.executable, TRAIN, "--strategy", strategy, "--hidden", str(hidden),
            "--checkpoint-every", "1", "--epochs", "1", "--num-samples", "32",
            "--checkpoint-dir", str(directory), *extra]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def fix(directory: Path) -> str:
    return (f"; free space in {directory} or make it writable, or pass another checkpoint_dir; "
            "the previous checkpoint is kept")


@pytest.mark.parametrize(("strategy", "hidden"), [("single", 1000), ("fsdp", 300)])
def test_a_full_disk_is_one_line_and_keeps_the_previous_checkpoint(tmp_path, strategy, hidden):
    # One checkpoint (~150 kB, with fsdp its DCP directory too) fits, two do not.
    with tmpfs(tmp_path, "256k"):
        ckpt = tmp_path / "ckpt"
        done = subprocess.run(command(ckpt, strategy=strategy, hidden=hidden),
                              capture_output=True, text=True, timeout=180, env=ENV)
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 1 and len(lines) == 1, done.stderr[-3000:]
        start = f"paratrain: cannot write checkpoint {ckpt / 'step-000000002.pt'} ("
        assert lines[0].startswith(start) and lines[0].endswith(fix(ckpt)), lines[0]
        reason = lines[0][len(start):-len(fix(ckpt)) - 1]
        assert re.fullmatch(r"No space left on device|rank 0: (OSError: \[Errno 28\] No space "
                            r"left on device.*|RuntimeError: .*)", reason), reason
        # No temp file, no staging directory, no lock: only the intact step 1.
        expected = ["step-000000001.pt"] + (["step-000000001.dcp"] if strategy == "fsdp" else [])
        assert sorted(os.listdir(ckpt)) == sorted(expected)
        assert inspect(ckpt / "step-000000001.pt")[0] == OK


@contextlib.contextmanager
def read_only(path: Path) -> Iterator[None]:
    """``path`` read-only from now on: a read-only bind mount over it. (Remounting the file
    system itself is refused while the run holds its lock file open for writing.)"""
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True)
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_a_directory_turned_read_only_is_one_line_and_the_next_run_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    job = subprocess.Popen(
        command(ckpt, strategy="single", hidden=32, extra=("--step-sleep", "1", "--log-steps")),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        for line in job.stdout:
            if line.startswith("step 1 "):  # printed once step 1's checkpoint is written
                break
        with read_only(ckpt):
            _, err = job.communicate(timeout=120)
            assert sorted(os.listdir(ckpt)) == ["paratrain.lock", "step-000000001.pt"]
    finally:
        job.kill()
    assert job.returncode == 1, err[-3000:]
    assert err.splitlines() == [
        f"paratrain: cannot write checkpoint {ckpt / 'step-000000002.pt'} (Read-only file "
        f"system){fix(ckpt)}"]
    # The lock could not be removed from the read-only directory: the next run takes it
    # over (its process is gone) and resumes from the intact step 1.
    again = subprocess.run(command(ckpt, strategy="single", hidden=32),
                           capture_output=True, text=True, timeout=180, env=ENV)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "was locked by a run that ended without releasing it" in again.stdout
    assert f"resumed from {ckpt / 'step-000000001.pt'} (epoch 0, step 1)" in again.stdout
    assert "paratrain.lock" not in os.listdir(ckpt)
