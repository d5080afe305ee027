"""The tracker hub with a real Run: rank 0 only, steps once across a resume, failures
that warn once and never stop training, and the one-line errors of ``loggers``."""

from __future__ import annotations

import importlib.util

import pytest
from trainer import STEPS_PER_EPOCH, Crash, train

import paratrain
from paratrain.trackers import Tracker


class Recording(Tracker):
    """Keeps what it is given, across the Run objects of one test."""

    name = "recording"

    def __init__(self, calls=None):
        self.calls = calls if calls is not None else []
        self.run_id = None

    def start(self, *, params, directory, resume):
        self.run_id = resume["run_id"] if resume else f"run-{len(self.calls)}"
        self.calls.append(("start", self.run_id, params, resume))
        logged = [step for op, run_id, step, _ in self.calls if op == "log" and run_id == self.run_id]
        return {"*": max(logged)} if resume and logged else None

    def log(self, metrics, step):
        self.calls.append(("log", self.run_id, step, metrics))

    def state(self):
        return {"run_id": self.run_id}

    def finish(self, *, failed):
        self.calls.append(("finish", self.run_id, failed, None))

    def logged(self, key):
        return [(step, m[key]) for op, _, step, m in self.calls if op == "log" and key in m]


class Broken(Recording):
    """Raises from its client after two rows, as a dead server or a full disk would."""

    name = "broken"

    def log(self, metrics, step):
        if len([c for c in self.calls if c[0] == "log"]) >= 2:
            raise ConnectionError("server at 127.0.0.1:5000 went away\n(second line)")
        super().log(metrics, step)


def test_configuration_layout_and_metrics_reach_the_tracker_with_their_step(tmp_path):
    tracker = Recording()
    losses = train(tmp_path, loggers=[tracker], tokens_per_sample=5)
    (op, _, params, resume), *_ = tracker.calls
    assert op == "start" and resume is None
    assert params["layout_strategy"] == "single" and params["world_size"] == 1
    assert params["seed"] == 0 and params["checkpoint_every"] == 4
    assert [(s, pytest.approx(v)) for s, v in tracker.logged("loss")] == sorted(losses.items())
    # Text is left out; rates and memory ride along with each row.
    assert all("note" not in m for op, *_, m in tracker.calls if op == "log")
    assert [s for s, _ in tracker.logged("throughput/tokens_per_s")] == list(range(1, 13))
    assert all(v > 0 for _, v in tracker.logged("memory/peak_mb"))
    # Each epoch's statistics at the step that ended it.
    assert [s for s, _ in tracker.logged("samples_per_s")] == [STEPS_PER_EPOCH, 12]
    assert tracker.calls[-1][0] == "finish" and tracker.calls[-1][2] is False


def test_a_resumed_run_continues_the_tracker_run_with_each_step_once(tmp_path):
    reference = train(tmp_path / "reference", loggers=[], checkpoint_every=None)
    calls = []
    # Checkpoint at step 4; steps 5 and 6 reach the tracker, then the run dies.
    with pytest.raises(Crash):
        train(tmp_path / "run", loggers=[Recording(calls)], crash_after=6)
    tracker = Recording(calls)
    train(tmp_path / "run", loggers=[tracker])
    starts = [c for c in calls if c[0] == "start"]
    assert starts[1][1] == starts[0][1] == "run-0"  # the same tracker run, re-opened
    assert starts[1][3] == {"run_id": "run-0", "step": 4}
    assert [c[2] for c in calls if c[0] == "finish"] == [True, False]  # crashed, then done
    steps = [s for s, _ in tracker.logged("loss")]
    assert steps == list(range(1, 13))  # 5 and 6 once, though computed twice
    assert [v for _, v in tracker.logged("loss")] == pytest.approx(
        [reference[s] for s in steps], abs=0)  # the resume is exact


def test_a_failing_tracker_warns_once_and_training_goes_on(tmp_path, capfd):
    reference = train(tmp_path / "reference", loggers=[], checkpoint_every=None)
    broken, other = Broken(), Recording()
    losses = train(tmp_path / "run", loggers=[broken, other])
    assert losses == reference
    warnings = [line for line in capfd.readouterr().err.splitlines() if "tracker" in line]
    assert warnings == ["paratrain: warning: tracker broken failed (ConnectionError: server at "
                        "127.0.0.1:5000 went away (second line)); it is off for the rest of "
                        "this run, training goes on"]
    assert [s for s, _ in broken.logged("loss")] == [1, 2]
    assert [s for s, _ in other.logged("loss")] == list(range(1, 13))  # the others go on


@pytest.mark.slow
def test_other_ranks_never_start_a_tracker(tmp_path):
    from paratrain.testing.pool import spawn

    started = spawn(_start_count, 2, str(tmp_path))
    assert started == [1, 0]


def _start_count(rank, world_size, directory):
    tracker = Recording()
    train(directory, loggers=[tracker], epochs=1, checkpoint_every=None)
    return len([c for c in tracker.calls if c[0] == "start"])


@pytest.mark.parametrize("loggers, message", [
    ("mlflow", "loggers must be a list of tracker names or Tracker objects, e.g. ['mlflow'], "
               "got 'mlflow'"),
    (["neptune"], "loggers entries must be one of 'mlflow', 'wandb', 'tensorboard' or a "
                  "paratrain.trackers.Tracker, got 'neptune' (for a .csv or .jsonl file use "
                  "metrics_path)"),
    (["wandb", "wandb"], "loggers names the tracker 'wandb' twice; give each one once"),
])
def test_bad_loggers_are_one_line(loggers, message):
    with pytest.raises(ValueError) as info:
        paratrain.Run(accelerator="cpu", progress=False, loggers=loggers)
    assert str(info.value) == message


@pytest.mark.parametrize("name, package", [("mlflow", "mlflow"), ("wandb", "wandb"),
                                           ("tensorboard", "tensorboard")])
def test_a_missing_client_names_the_extra_to_install(monkeypatch, name, package):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda module, *a: None if module == package else find_spec(module, *a))
    with pytest.raises(ValueError) as info:
        paratrain.Run(accelerator="cpu", progress=False, loggers=[name])
    assert str(info.value) == (f"loggers: {name!r} needs the {package} package, which is not "
                               "installed: pip install 'paratrain[trackers]'")
