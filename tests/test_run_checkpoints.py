"""Run-level checkpoint behaviour in one process: fail early, fall back, save once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain import checkpoint


def train(directory, num_steps, **kwargs):
    torch.manual_seed(0)
    run = paratrain.Run(strategy="single", accelerator="cpu", progress=False,
                        checkpoint_dir=str(directory), **kwargs)
    model = nn.Linear(4, 2)
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in run.epochs(1):
        for _ in range(num_steps - run.global_step):
            run.backward(model(torch.randn(3, 4)).sum())
            run.step(optimizer)
    return run


def test_unusable_checkpoint_dir_fails_when_the_run_is_created(tmp_path):
    (tmp_path / "taken").write_text("a file")
    with pytest.raises(ValueError, match="checkpoint_dir .*taken' is a file"):
        paratrain.Run(strategy="single", checkpoint_dir=str(tmp_path / "taken"))


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    train(tmp_path, 2, checkpoint_every=1).close()
    older, newest = checkpoint.list_checkpoints(tmp_path)
    newest.write_bytes(newest.read_bytes()[:100])
    run = train(tmp_path, 0)
    out = capsys.readouterr().out
    assert f"{newest} is corrupt or truncated" in out
    assert f"resuming from {older} instead" in out
    assert run.global_step == 1
    run.close()


def test_only_damaged_checkpoints_still_fail_in_one_error(tmp_path):
    train(tmp_path, 1, checkpoint_every=1).close()
    (only,) = checkpoint.list_checkpoints(tmp_path)
    only.write_text("not a checkpoint")
    with pytest.raises(checkpoint.CheckpointError, match="corrupt or truncated"):
        train(tmp_path, 0)


def test_saving_a_step_that_is_already_saved_is_a_no_op(tmp_path, monkeypatch):
    writes = []
    real_save = checkpoint.atomic_save
    monkeypatch.setattr(checkpoint, "atomic_save",
                        lambda state, path: writes.append(path) or real_save(state, path))
    run = train(tmp_path, 2, checkpoint_every=2)
    assert len(writes) == 1
    assert run.save() == str(writes[0])  # the end-of-epoch save of the same step
    assert len(writes) == 1
    run.close()
