"""TensorBoard as a tracker: the same event folder across a resume, each step once."""

from __future__ import annotations

import pytest
from trainer import Crash, train

pytest.importorskip("tensorboard", reason="pip install 'paratrain[trackers]'")


def scalars(directory, key):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory))
    events.Reload()  # applies the purge a resumed writer recorded, as TensorBoard does
    return [(e.step, e.value) for e in events.Scalars(key)]


def test_a_resumed_run_purges_the_interrupted_steps_and_logs_each_once(tmp_path):
    reference = train(tmp_path / "reference", loggers=[], checkpoint_every=None)
    with pytest.raises(Crash):
        train(tmp_path / "run", loggers=["tensorboard"], crash_after=6)
    train(tmp_path / "run", loggers=["tensorboard"])
    logged = scalars(tmp_path / "run" / "trackers" / "tensorboard", "loss")
    # Event files hold float32: within its rounding (2**-24 relative) of the float64 loss.
    assert logged == [(s, pytest.approx(v, rel=2**-24)) for s, v in sorted(reference.items())]


def test_tensorboard_dir_is_written_once_with_the_tracker(tmp_path):
    losses = train(tmp_path, loggers=["tensorboard"], tensorboard_dir=str(tmp_path / "tb"),
                   checkpoint_every=None)
    assert [s for s, _ in scalars(tmp_path / "tb", "loss")] == sorted(losses)
