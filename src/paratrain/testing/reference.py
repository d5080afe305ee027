"""Pieces shared by equivalence tests: a deterministic dataset and a k-step training loop.

Every strategy is tested the same way: train a few steps under the strategy and under
``single`` with the same global batch, then compare parameters and losses. Keeping the
data and the loop in one place keeps those comparisons about the strategy, not the test.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def synthetic_classification(num_samples: int = 96, *, num_features: int = 10,
                             seed: int = 1234) -> TensorDataset:
    """A fixed 3-class problem: the same tensors in every process for a given seed."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_samples, num_features, generator=g)
    y = (x[:, :3].sum(dim=1) > 0).long() + (x[:, 3] > 1).long()
    return TensorDataset(x, y)


def train_steps(run: Any, model: Any, optimizer: Any, loader: Any, *, num_steps: int,
                num_epochs: int = 1, mean_losses: bool = True) -> list[float]:
    """Run ``num_steps`` micro-steps in each of ``num_epochs`` epochs; return the rank-mean losses.

    ``mean_losses=False`` skips the per-step ``run.mean`` (a collective) and returns [].
    """
    losses = []
    for _ in run.epochs(num_epochs):
        for step, (x, y) in enumerate(loader):
            if step == num_steps:
                break
            loss = F.cross_entropy(model(x), y)
            run.backward(loss)
            run.step(optimizer)
            if mean_losses:
                losses.append(run.mean(loss))
    return losses
