"""Weights & Biases through its own client, offline (no network): the run's files are
read back to check the configuration and the logged steps, across a resume."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from trainer import STEPS_PER_EPOCH, Crash, train

from paratrain.trackers.wandb import history, offline_files, records

pytest.importorskip("wandb", reason="pip install 'paratrain[trackers]'")


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")


def attempts(directory):
    """Each offline attempt's run id, config and history rows, oldest first."""
    found = []
    for path in sorted((directory / "trackers" / "wandb").glob("offline-run-*/run-*.wandb")):
        (run,) = [r.run for r in records(path) if r.WhichOneof("record_type") == "run"]
        config = {u.key: json.loads(u.value_json) for u in run.config.update}
        found.append((run.run_id, config, history(path)))
    return found


@pytest.mark.slow
def test_a_resumed_run_continues_the_same_wandb_run_with_each_step_once(tmp_path):
    reference = train(tmp_path / "reference", loggers=[], checkpoint_every=None)
    # Checkpoint at step 4; steps 5 and 6 reach the files, then the run dies.
    with pytest.raises(Crash):
        train(tmp_path / "run", loggers=["wandb"], crash_after=6)
    # W&B names an offline attempt's folder by the second it starts in: a restart within
    # the same second would share (and overwrite) the first one's folder.
    time.sleep(1.1)
    train(tmp_path / "run", loggers=["wandb"])
    (first_id, config, first), (second_id, _, second) = attempts(tmp_path / "run")
    assert first_id == second_id  # one W&B run, continued (wandb sync joins the attempts)
    assert offline_files(tmp_path / "run" / "trackers", first_id)
    assert (config["layout_strategy"], config["world_size"], config["seed"]) == ("single", 1, 0)
    losses = [(step, row["loss"]) for step, row in first + second if "loss" in row]
    assert losses == sorted(reference.items())  # 5 and 6 once, though computed twice
    assert [step for step, row in first if "loss" in row] == [1, 2, 3, 4, 5, 6]
    epochs = [step for step, row in first + second if "samples_per_s" in row]
    assert epochs == [STEPS_PER_EPOCH, 12]
    assert all(row["memory/peak_mb"] > 0 for _, row in first + second if "loss" in row)


@pytest.mark.slow
def test_a_killed_run_keeps_every_step_before_its_checkpoint(tmp_path):
    # SIGKILL right after step 10; checkpoints at steps 4 and 8. Nothing is finished, so
    # what the offline file holds is what the checkpoints made durable (and what W&B's
    # service wrote since).
    script = f"from trainer import train; train({str(tmp_path / 'run')!r}, loggers=['wandb'])"
    killed = subprocess.run(
        [sys.executable, "-c", script], cwd=Path(__file__).parent, capture_output=True,
        text=True, timeout=300, env={**os.environ, "PARATRAIN_KILL_AT_STEP": "10"})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    ((_, _, first),) = attempts(tmp_path / "run")
    assert [step for step, row in first if "loss" in row][:7] == [1, 2, 3, 4, 5, 6, 7]
    time.sleep(1.1)  # a new second: the resumed attempt gets a folder of its own
    train(tmp_path / "run", loggers=["wandb"])
    reference = train(tmp_path / "reference", loggers=[], checkpoint_every=None)
    rows = [(step, row["loss"]) for _, _, history_ in attempts(tmp_path / "run")
            for step, row in history_ if "loss" in row]
    assert len({step for step, _ in rows}) == len(rows)  # no step twice
    # Known gap (docs/trackers.md): step 8's row is logged after its own checkpoint.
    assert [r for r in sorted(rows) if r[0] != 8] == [r for r in sorted(reference.items())
                                                       if r[0] != 8]
