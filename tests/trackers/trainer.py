"""A small real training run that logs its loss every step, for the tracker tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain

STEPS_PER_EPOCH = 6  # 48 samples, batches of 8


class Crash(RuntimeError):
    """Raised inside the loop to stand for a killed run."""


def dataset(n: int = 48) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def train(checkpoint_dir, *, loggers, epochs: int = 2, crash_after: int | None = None,
          checkpoint_every: int | None = 4, **config) -> list[float]:
    """Train, ``run.log`` the loss at every step; raise :class:`Crash` after ``crash_after``.

    Returns the logged losses by step (index 0 is step 1) of this attempt.
    """
    losses: dict[int, float] = {}
    with paratrain.Run(accelerator="cpu", progress=False, loggers=loggers,
                       checkpoint_dir=str(checkpoint_dir), checkpoint_every=checkpoint_every,
                       **config) as run:
        model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = run.loader(dataset(), batch_size=8)
        for _ in run.epochs(epochs):
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                run.backward(loss)
                run.step(optimizer)
                run.log({"loss": loss, "note": "text is not a metric"})
                losses[run.global_step] = loss.item()
                if run.global_step == crash_after:
                    raise Crash(f"crash after step {crash_after}")
    return losses
