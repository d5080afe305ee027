"""LocalSGD and DiLoCo across fault-tolerant replica groups (``--fault-tolerant``).

The groups meet only at outer syncs, through torchft. Without failures two groups of one
rank must train exactly as the same mode over two ranks of one job (the replicate axis
of a process group; that reference runs on the rank pool); with a group killed, the survivor never stops, and the restarted
group heals into the survivor's next sync and is its replica again after it.
"""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from paratrain import DiLoCo
from paratrain.fault_tolerance.axis import replica_groups

pytest.importorskip("torchft", reason="needs torchft (pip install 'paratrain[ft]')")

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ft_train.py"
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fault_tolerant_launch import _finish, _reference, _steps, _wait_for_step  # noqa: E402


def _launch(out: Path, mode: dict, *flags: str, sleep_s: float = 0.0, epochs: int = 1,
            parallel: str = "") -> subprocess.Popen:
    argv = [sys.executable, "-m", "paratrain.cli", "launch", *flags, str(SCRIPT), str(out),
            str(sleep_s), str(epochs)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "FT_TEST_SEMI_SYNC": json.dumps(mode),
                                 "FT_TEST_PARALLEL": parallel})


# bf16 pseudo-gradients: the same round, other messages (their arithmetic: test_rounds.py).
MODES = [{"kind": "DiLoCo", "every": 4}, {"kind": "LocalSGD", "every": 4}]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m["kind"])
def test_groups_train_bitwise_as_the_same_mode_over_two_ranks(tmp_path, mode):
    ft_dir, plain_dir = tmp_path / "ft", tmp_path / "plain"
    ft_dir.mkdir()
    plain_dir.mkdir()
    ft = _launch(ft_dir, mode, "--fault-tolerant", "--replica-groups", "2")
    output = _finish(ft)
    _reference(plain_dir, epochs=1, env={"FT_TEST_SEMI_SYNC": json.dumps(mode)})
    assert "2 fault-tolerant replica groups" in output, output[-2000:]
    for group in (0, 1):
        groups = _steps(ft_dir / f"group{group}-rank0.jsonl")
        ranks = _steps(plain_dir / f"group0-rank{group}.jsonl")
        assert [s["step"] for s in groups] == list(range(1, 17))
        # Inner steps alone and outer syncs summed over the groups, divided by the groups
        # that sent: the same arithmetic as over the replicate process group, bit for bit.
        assert [s["digest"] for s in groups] == [s["digest"] for s in ranks]
        assert [s["samples"] for s in groups] == [s["samples"] for s in ranks]
    a, b = (_steps(ft_dir / f"group{g}-rank0.jsonl") for g in (0, 1))
    synced = [x["step"] for x, y in zip(a, b) if x["digest"] == y["digest"]]
    assert synced == [4, 8, 12, 16]  # replicas of each other right after each sync only


@pytest.mark.slow
def test_fsdp_inside_each_group_is_hsdp_diloco(tmp_path):
    """Two groups of two FSDP ranks: rank i of group g holds, step by step, the shard of
    rank 2g + i of DiLoCo over dp_replicate=2 x dp_shard=2 in one job."""
    mode = {"kind": "DiLoCo", "every": 4}
    ft_dir, plain_dir = tmp_path / "ft", tmp_path / "plain"
    ft_dir.mkdir()
    plain_dir.mkdir()
    _finish(_launch(ft_dir, mode, "--fault-tolerant", "--replica-groups", "2",
                    "--nproc-per-node", "2"))
    _reference(plain_dir, nproc=4, epochs=1, env={"FT_TEST_SEMI_SYNC": json.dumps(mode),
                                                   "FT_TEST_PARALLEL": "dp_replicate=2,dp_shard=2"})
    for group in (0, 1):
        for rank in (0, 1):
            shards = _steps(ft_dir / f"group{group}-rank{rank}.jsonl")
            plain = _steps(plain_dir / f"group0-rank{2 * group + rank}.jsonl")
            assert len(shards) == 8
            assert [s["digest"] for s in shards] == [s["digest"] for s in plain]


@pytest.mark.parametrize("mode, expected", [
    (DiLoCo(every=4, comm_dtype="int8"), "DiLoCo(comm_dtype='int8') gathers every group's bytes"),
    (DiLoCo(every=4, overlap=True), "DiLoCo(overlap=True) keeps a sync in flight")])
def test_int8_and_overlap_are_refused_in_one_line_under_fault_tolerance(mode, expected):
    settings = SimpleNamespace(replica_group="0/2", lighthouse="http://h:1")
    with pytest.raises(ValueError, match=re.escape(expected)) as info:
        replica_groups(None, settings, None, print, SimpleNamespace(semi_sync=mode))
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_a_killed_group_heals_into_the_next_sync_and_the_survivor_never_stops(tmp_path):
    """SIGKILL group 1's worker mid-round: group 0 keeps taking its inner steps and its
    syncs (alone); torchrun restarts group 1, which waits in its first quorum for group
    0's next sync, heals from it there, sends no progress of its own to that sync (so
    the outer step is group 0's own) and is group 0's replica after every sync since."""
    mode = {"kind": "DiLoCo", "every": 4}
    proc = _launch(tmp_path, mode, "--fault-tolerant", "--replica-groups", "2",
                   "--max-restarts", "2", sleep_s=0.2, epochs=4)
    survivor, victim = tmp_path / "group0-rank0.jsonl", tmp_path / "group1-rank0.jsonl"
    killed = []
    try:
        row = _wait_for_step(victim, 10)  # mid-round: the last sync was after step 8
        os.kill(row["pid"], signal.SIGKILL)
        killed.append(row["pid"])
        _wait_for_step(victim, row["step"] + 8)  # restarted, healed and training again
    finally:
        if proc.poll() is None and not killed:
            proc.send_signal(signal.SIGTERM)
    output = _finish(proc)
    steps = _steps(survivor)
    assert [s["step"] for s in steps] == list(range(1, 65)), "a survivor step lost or repeated"
    stall = max(b["t"] - a["t"] for a, b in zip(steps, steps[1:]))
    assert stall < 10.0, f"the survivor stalled {stall:.1f} s"
    assert output.count("healed from a live peer") == 1, output[-3000:]
    assert "the mean of 1 of 2 replica groups (1 healed" in output, output[-3000:]
    healed = [s for s in _steps(victim) if s["pid"] not in killed]
    first = healed[0]["step"]
    by_step = {s["step"]: s["digest"] for s in steps}
    syncs = [s["step"] for s in healed if s["step"] % 4 == 0]
    assert syncs and all(by_step[step] == d for step, d in
                         ((s["step"], s["digest"]) for s in healed if s["step"] % 4 == 0))
    assert first % 4 == 1, "the healed group resumes right after the sync it healed into"
    # Healed into the epoch its peer is in (also at an epoch's last step: the next one).
    epochs = {s["step"]: s["epoch"] for s in steps}
    assert all(epochs[s["step"]] == s["epoch"] for s in healed)
    # Within the victim group no step and no sample is trained twice in an epoch.
    rows = _steps(victim)
    assert len({s["step"] for s in rows}) == len(rows), "a step repeated in the victim group"
    for epoch in range(4):
        seen = [i for s in rows if s["epoch"] == epoch for i in s["samples"]]
        assert len(seen) == len(set(seen)), f"a sample trained twice in epoch {epoch}"
