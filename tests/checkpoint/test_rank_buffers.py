"""Buffers that differ per rank (BatchNorm statistics under fsdp) resume exactly.

Under ``fsdp`` each rank normalises its own micro-batches, so its BatchNorm running
statistics are its own (nothing broadcasts them, unlike DDP). A sharded checkpoint used
to keep one copy of each buffer, so every other rank resumed with someone else's
statistics. Now each rank's persistent buffers are saved beside the shared copy and
restored on the rank that wrote them.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.distributed.device import free_port
from paratrain.strategies.capabilities import local_module
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification

STOP_AT, TOTAL = 2, 4  # 6 steps per epoch: the resumed run continues mid-epoch


def bn_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach().clone()


def train(strategy: str, *, checkpoint_dir: str | None = None, stop_at: int | None = None,
          options: dict | None = None) -> dict:
    """Train to ``TOTAL`` steps (or save at ``stop_at`` and stop); this rank's state."""
    losses = []
    with paratrain.Run(strategy=strategy, strategy_options=options or {}, accelerator="cpu",
                       progress=False, seed=5, checkpoint_dir=checkpoint_dir) as run:
        model = bn_model()
        model, optimizer = run.prepare(
            model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1))
        loader = run.loader(synthetic_classification(48), batch_size=4)
        for _ in run.epochs(1):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                run.backward(loss)
                run.step(optimizer)
                losses.append(loss.detach().clone())
                if run.global_step in (stop_at, TOTAL):
                    break
        if stop_at is not None:
            run.save()
        module = local_module(run.strategy, model)
        return {"losses": losses,
                "params": {k: _local(v) for k, v in module.named_parameters()},
                "buffers": {k: _local(v) for k, v in module.named_buffers()},
                "optimizer": [_local(v) for s in optimizer.state.values() for v in s.values()
                              if isinstance(v, torch.Tensor)]}


def resume_worker(rank: int, world_size: int, directory: str, strategy: str, ports: list[int],
                  options: dict | None = None) -> dict:
    results = []
    # Each Run creates and destroys its own process group, each on a port of its own (a
    # group re-created on the port of a destroyed one can wait forever): the resumed run
    # starts in a fresh group.
    for port, kwargs in zip(ports, ({}, {"checkpoint_dir": directory, "stop_at": STOP_AT},
                                    {"checkpoint_dir": directory})):
        os.environ["MASTER_PORT"] = str(port)
        results.append(train(strategy, options=options, **kwargs))
    whole, _, resumed = results
    return {"whole": whole, "resumed": resumed}


def ports() -> list[int]:
    return [free_port() for _ in range(3)]


def differences(result: dict) -> list[str]:
    whole, resumed = result["whole"], result["resumed"]
    found = []
    if not torch.equal(torch.stack(whole["losses"][STOP_AT:]), torch.stack(resumed["losses"])):
        found.append("losses")
    for kind in ("params", "buffers"):
        found += [f"{kind} {name}" for name, value in whole[kind].items()
                  if not torch.equal(value, resumed[kind][name])]
    if not all(torch.equal(a, b) for a, b in zip(whole["optimizer"], resumed["optimizer"])):
        found.append("optimizer")
    return found


@pytest.mark.slow
def test_fsdp_with_batchnorm_resumes_bitwise(tmp_path):
    """Losses, parameters, every rank's buffers and optimizer state equal the uninterrupted run."""
    results = spawn(resume_worker, 2, str(tmp_path), "fsdp", ports(), timeout=300)
    # Not vacuous: the ranks' statistics really differ, so one shared copy could not do.
    assert not torch.equal(results[0]["whole"]["buffers"]["1.running_mean"],
                           results[1]["whole"]["buffers"]["1.running_mean"])
    assert [differences(r) for r in results] == [[], []]
