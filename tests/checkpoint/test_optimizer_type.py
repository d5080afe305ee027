"""A checkpoint records its optimizer's type; resuming it with another type is refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.checkpoint import files as checkpoint
from paratrain.checkpoint.files import CheckpointError


def train_one_epoch(directory, make_optimizer):
    """One epoch of 2 steps with ``make_optimizer``, resuming from ``directory``."""
    with paratrain.Run(accelerator="cpu", progress=False, checkpoint_dir=str(directory),
                       checkpoint_every=1) as run:
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        model, optimizer = run.prepare(model, make_optimizer(model.parameters()))
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        for _ in run.epochs(run.state.epoch + 1):
            for _ in range(2):
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
        return run.global_step


def adam(params):
    return torch.optim.Adam(params, lr=0.01)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def test_resuming_an_adam_checkpoint_with_sgd_is_refused_in_one_line(tmp_path):
    train_one_epoch(tmp_path, adam)
    path = checkpoint.latest_checkpoint(tmp_path)
    assert checkpoint.safe_load(path)["optimizer_types"] == ["Adam"]
    with pytest.raises(CheckpointError) as refused:
        train_one_epoch(tmp_path, sgd)
    assert str(refused.value) == (
        f"checkpoint {path} was written with optimizer Adam but this run's optimizer is SGD; "
        "resume with Adam (one's state does not fit the other), or start from another "
        "checkpoint_dir")


def test_the_same_optimizer_resumes(tmp_path):
    assert train_one_epoch(tmp_path, adam) == 2
    assert train_one_epoch(tmp_path, adam) == 4


def test_a_checkpoint_without_the_record_still_loads(tmp_path):
    train_one_epoch(tmp_path, sgd)
    path = checkpoint.latest_checkpoint(tmp_path)
    state = checkpoint.safe_load(path)
    del state["optimizer_types"]  # as written by an older paratrain
    checkpoint.atomic_save(state, path)
    assert train_one_epoch(tmp_path, sgd) == 4


def test_a_sharded_optimizer_is_named_by_the_one_it_shards():
    class Sharding(torch.optim.Optimizer):  # stands in for ZeroRedundancyOptimizer
        def __init__(self, inner):
            self.optim = inner

    inner = adam([nn.Parameter(torch.zeros(2))])
    assert checkpoint.optimizer_types([Sharding(inner), inner]) == ["Adam", "Adam"]
