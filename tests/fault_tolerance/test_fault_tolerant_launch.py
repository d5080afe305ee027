"""Fault-tolerant jobs through ``paratrain launch --fault-tolerant``: real torchft quorums.

Each job runs ``tests/scripts/ft_train.py``, which logs a digest of every rank's
parameters after each step; the tests compare replica groups with each other, with plain
DDP, and across a kill and the healing that follows. The fault-tolerant jobs are real
launches; the plain references they are compared with run the same script unchanged on
the rank pool (``run_script``: the environment ``paratrain launch`` gives it).
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.testing.pool import run_script

pytest.importorskip("torchft", reason="needs torchft (pip install 'paratrain[ft]')")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ft_train.py"


def _launch(out: Path, *flags: str, sleep_s: float = 0.0, epochs: int = 2,
            env: dict | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-m", "paratrain.cli", "launch", *flags, str(SCRIPT), str(out),
            str(sleep_s), str(epochs)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def _reference(out: Path, *, nproc: int = 2, epochs: int = 2,
               env: dict | None = None) -> None:
    """The script without fault tolerance, as ``paratrain launch --nproc-per-node NPROC``
    runs it, on pool ranks (a reference computation, no launcher behaviour under test)."""
    for rank, ran in enumerate(run_script(str(SCRIPT), str(out), "0.0", str(epochs),
                                          nproc=nproc, env=env, timeout=240)):
        assert ran.returncode == 0, f"rank {rank}:\n{ran.stderr[-3000:]}"


def _steps(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finish(proc: subprocess.Popen, timeout: float = 240.0) -> str:
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
        pytest.fail(f"the job did not end in {timeout:g} s:\n{output[-3000:]}")
    assert proc.returncode == 0, output[-3000:]
    return output


def test_two_replica_groups_train_bitwise_as_two_rank_ddp(tmp_path):
    ft_dir, ddp_dir = tmp_path / "ft", tmp_path / "ddp"
    ft_dir.mkdir()
    ddp_dir.mkdir()
    checkpoints = tmp_path / "checkpoints"
    _finish(_launch(ft_dir, "--fault-tolerant", "--replica-groups", "2",
                    env={"FT_TEST_CHECKPOINT_DIR": str(checkpoints)}))
    _reference(ddp_dir)
    group0, group1 = _steps(ft_dir / "group0-rank0.jsonl"), _steps(ft_dir / "group1-rank0.jsonl")
    ddp = _steps(ddp_dir / "group0-rank0.jsonl")
    assert [s["step"] for s in group0] == list(range(1, 33))  # 2 epochs of 512 / (2 x 16)
    # Each group its half of every global batch, the gradients averaged over both: the
    # same updates as DDP over two ranks (an average of two is exact in either order).
    assert [s["digest"] for s in group0] == [s["digest"] for s in group1]
    assert [s["digest"] for s in group0] == [s["digest"] for s in ddp]
    # Group g reads what DDP's rank g reads, step by step.
    for group in (0, 1):
        ft = _steps(ft_dir / f"group{group}-rank0.jsonl")
        plain = _steps(ddp_dir / f"group0-rank{group}.jsonl")
        assert [s["samples"] for s in ft] == [s["samples"] for s in plain]
    # Each group is its own job with its own rank 0: its own checkpoints, side by side.
    for group in (0, 1):
        assert sorted(p.name for p in (checkpoints / f"replica-group-{group}").glob("*.pt"))


@pytest.mark.slow
def test_hsdp_groups_stay_replicas_of_each_other(tmp_path):
    """FSDP inside each group of 2 ranks, torchft across the groups: rank i of one group
    holds the same shard, bitwise, as rank i of the other after every step."""
    _finish(_launch(tmp_path, "--fault-tolerant", "--replica-groups", "2", "--nproc-per-node",
                    "2", epochs=1, env={"FT_TEST_STRATEGY": "fsdp"}))
    for rank in (0, 1):
        a = _steps(tmp_path / f"group0-rank{rank}.jsonl")
        b = _steps(tmp_path / f"group1-rank{rank}.jsonl")
        assert len(a) == 8 and [s["digest"] for s in a] == [s["digest"] for s in b]
    shards = {s["digest"] for s in _steps(tmp_path / "group0-rank0.jsonl")}
    assert shards.isdisjoint(s["digest"] for s in _steps(tmp_path / "group0-rank1.jsonl"))


def _wait_for_step(path: Path, step: int, timeout: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rows = _steps(path)
        if rows and rows[-1]["step"] >= step:
            return rows[-1]
        time.sleep(0.05)
    pytest.fail(f"{path.name} did not reach step {step} in {timeout:g} s")


@pytest.mark.slow
def test_killed_group_leaves_the_quorum_survivor_keeps_training_and_it_heals(tmp_path):
    """SIGKILL group 1's worker twice: group 0 never stops (no step lost, skipped or
    repeated, the longest stall well under 10 s); torchrun restarts group 1, which heals
    from group 0 and is bitwise its replica again."""
    proc = _launch(tmp_path, "--fault-tolerant", "--replica-groups", "2", "--max-restarts", "3",
                   sleep_s=0.3, epochs=6)  # long enough for two restarts (a few s each)
    survivor, victim = tmp_path / "group0-rank0.jsonl", tmp_path / "group1-rank0.jsonl"
    killed = []
    try:
        for at in (8, 50):
            row = _wait_for_step(victim, at)
            os.kill(row["pid"], signal.SIGKILL)
            killed.append(row["pid"])
            _wait_for_step(victim, at + 4)  # restarted, healed and training again
    finally:
        if proc.poll() is None and len(killed) < 2:  # no job left behind by a failure
            proc.send_signal(signal.SIGTERM)
    output = _finish(proc)
    steps = _steps(survivor)
    assert [s["step"] for s in steps] == list(range(1, 97)), "a step lost or repeated"
    # Every step changed the survivor's weights: a step whose all-reduce a dying peer
    # broke was averaged again in a new quorum, not skipped.
    assert all(a["digest"] != b["digest"] for a, b in zip(steps, steps[1:]))
    assert "not committed" not in output, output[-3000:]
    stall = max(b["t"] - a["t"] for a, b in zip(steps, steps[1:]))
    assert stall < 10.0, f"the survivor stalled {stall:.1f} s"
    healed = [s for s in _steps(victim) if s["pid"] not in killed]
    by_step = {s["step"]: s["digest"] for s in steps}
    assert healed and all(by_step[s["step"]] == s["digest"] for s in healed)
    assert output.count("healed from a live peer") == 2, output[-3000:]
    # The data guarantee: within the victim group no sample is trained twice in an epoch
    # (the killed process's steps and the healed one's never overlap), and the healed
    # process reads, at each step, the same samples the group would have read anyway.
    rows = _steps(victim)
    for epoch in range(6):
        seen = [i for s in rows if s["epoch"] == epoch for i in s["samples"]]
        assert len(seen) == len(set(seen)), f"a sample trained twice in epoch {epoch}"
    survivor_epochs = {s["step"]: s["epoch"] for s in steps}
    assert all(survivor_epochs[s["step"]] == s["epoch"] for s in rows)
    assert len({s["step"] for s in rows}) == len(rows), "a step repeated in the victim group"


def test_an_unreachable_lighthouse_is_one_line_naming_it(tmp_path):
    options = {"collective_timeout_s": 1, "step_timeout_s": 2, "quorum_timeout_s": 4,
               "connect_timeout_s": 1}
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True,
        timeout=120, env={**os.environ, "PARATRAIN_REPLICA_GROUP": "0/2", "RUST_LOG": "off",
                          "PARATRAIN_LIGHTHOUSE": "http://127.0.0.1:9",
                          "FT_TEST_OPTIONS": json.dumps(options)})
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("paratrain:")]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "could not join a quorum at the lighthouse http://127.0.0.1:9" in lines[0]
    assert "--lighthouse" in lines[0]
