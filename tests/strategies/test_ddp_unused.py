"""ddp's unused parameters and a second ``prepare`` end in one line naming the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import paratrain
from paratrain.strategies.ddp import reducer_parameter_names, unused_parameters_line
from paratrain.testing.pool import spawn


class WithUnusedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 8)
        self.unused_head = nn.Linear(8, 3)  # never called in forward
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def train_steps(options, steps=3):
    with paratrain.Run(strategy="ddp", accelerator="cpu", progress=False,
                       strategy_options=options) as run:
        torch.manual_seed(0)
        model = WithUnusedHead()
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        try:
            for _ in range(steps):
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
        except RuntimeError as exc:
            return str(exc)
        return run.global_step


def unused_worker(rank, world_size):
    return train_steps({}), train_steps({"find_unused_parameters": True})


@pytest.mark.slow
def test_unused_parameters_are_named_with_the_option_that_allows_them():
    for failed, trained in spawn(unused_worker, 2, timeout=180):
        assert failed == ("strategy 'ddp': parameters that received no gradient: "
                          "unused_head.weight, unused_head.bias; pass strategy_options="
                          "{'find_unused_parameters': True}, use them in the loss, or freeze "
                          "them (requires_grad_(False)) before run.prepare()")
        assert trained == 3  # the option the line names is accepted and trains


def prepare_twice_worker(rank, world_size):
    with paratrain.Run(strategy="ddp", accelerator="cpu", progress=False) as run:
        model = nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        wrapped, prepared = run.prepare(model, optimizer)
        assert isinstance(wrapped, DistributedDataParallel)
        messages = []
        for again, opt in ((wrapped, prepared), (model, optimizer)):
            try:
                run.prepare(again, opt)
            except ValueError as exc:
                messages.append(str(exc))
        return messages


@pytest.mark.slow
def test_prepare_twice_on_the_same_model_is_refused():
    expected = ("run.prepare() was called twice on the same model; call it once per model and "
                "train the model it returned (model, optimizer = run.prepare(model, optimizer))")
    assert spawn(prepare_twice_worker, 2, timeout=180) == [[expected, expected]] * 2


class Shared(nn.Module):
    """Names in DDP's order: per module its own parameters, frozen and shared ones left out."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(2, 2).requires_grad_(False)
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)
        self.b.weight = self.a.weight


class FakeDDP:
    module = Shared()
    parameters_to_ignore = {"b.bias"}


def test_indices_in_ddp_messages_map_to_names():
    assert reducer_parameter_names(FakeDDP()) == ["a.weight", "a.bias"]
    line = unused_parameters_line(FakeDDP(), "...\nParameter indices which did not receive grad "
                                  "for rank 1: 1\n In addition, ...")
    assert "no gradient: a.bias;" in line
    detailed = unused_parameters_line(FakeDDP(), "Parameters which did not receive grad for "
                                      "rank 0: x.bias, x.weight\nParameter indices ...: 0 1")
    assert "no gradient: x.bias, x.weight;" in detailed
