"""An LR scheduler given to ``run.prepare`` drives the optimizer the strategy hands back,
also where the strategy rebuilt it over new parameters (fsdp, zero1)."""

import warnings

import pytest
import torch
from torch import nn

import paratrain
from paratrain.testing.pool import spawn


def train(strategy):
    run = paratrain.Run(strategy=strategy, progress=False, accelerator="cpu", seed=1)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.8)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    prepared_model, prepared = run.prepare(model, optimizer, scheduler)
    rebuilt = prepared is not optimizer
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            run.backward(prepared_model(torch.randn(2, 4)).square().mean())
            run.step(prepared)
    lrs = [group["lr"] for group in prepared.param_groups]
    run.close()
    return rebuilt, lrs, [str(w.message) for w in caught if "scheduler" in str(w.message)]


def worker(rank, world_size, strategy):
    return train(strategy)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["fsdp", "zero1"])
def test_a_rebuilt_optimizer_follows_the_schedule(strategy):
    for rebuilt, lrs, scheduler_warnings in spawn(worker, 2, strategy, timeout=120):
        assert rebuilt  # the case this is about: prepare() returned a new optimizer
        assert lrs == pytest.approx([0.8 * 0.5 ** 3] * len(lrs))
        assert scheduler_warnings == []


def test_a_scheduler_of_another_optimizer_is_refused():
    run = paratrain.Run(strategy="single", progress=False, accelerator="cpu")
    model = nn.Linear(2, 2)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(other, step_size=1)
    with pytest.raises(ValueError, match="the scheduler passed to prepare\\(\\) drives another "
                                         "optimizer"):
        run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), scheduler)
    run.close()
