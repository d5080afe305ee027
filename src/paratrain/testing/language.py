"""The next-token training loop the layout tests share: random token sequences, a few
steps of cross entropy through ``Run``, an evaluation, and what the layout made of the
model (its mesh axes, its whole state), for comparison with one process.

Example:
    >>> run = paratrain.Run(strategy="single", progress=False)        # doctest: +SKIP
    >>> model, optimizer = run.prepare(model, optimizer)              # doctest: +SKIP
    >>> losses = train_steps(run, model, optimizer,                   # doctest: +SKIP
    ...                      run.loader(token_dataset(48, 16, 8), batch_size=8), steps=3)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from paratrain.strategies.capabilities import ShardedState

__all__ = ["evaluate_tokens", "layout_meshes", "token_dataset", "train_steps", "whole_state"]


def token_dataset(n: int, vocab: int, block: int, *, seed: int = 7) -> TensorDataset:
    """``n`` random sequences of ``block + 1`` tokens as (inputs, next tokens) pairs."""
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(vocab, (n, block + 1), generator=generator)
    return TensorDataset(data[:, :-1], data[:, 1:])


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor,
                     reduction: str = "mean") -> torch.Tensor:
    # (B, vocab, T) logits: a pipeline splits the targets (B, T) with the batch.
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction=reduction)


def train_steps(run: Any, model: nn.Module, optimizer: torch.optim.Optimizer,
                loader: Iterable, steps: int) -> list[float]:
    """``steps`` optimizer steps over ``loader``; each step's loss averaged over ranks."""
    losses = []
    for _, (x, y) in zip(range(steps), loader):
        loss = _next_token_loss(model(x), y)
        run.backward(loss)
        run.step(optimizer)
        losses.append(run.mean(loss))
    return losses


def evaluate_tokens(run: Any, model: nn.Module, dataset: TensorDataset,
                    batch_size: int = 4) -> dict[str, float]:
    """``run.evaluate`` with the summed next-token loss (``{"loss": ..., ...}``)."""
    return run.evaluate(model, run.eval_loader(dataset, batch_size=batch_size),
                        loss_fn=lambda out, y: _next_token_loss(out, y, reduction="sum"))


def layout_meshes(model: nn.Module) -> set[tuple[str, ...]]:
    """The mesh axes the model's local parameters are DTensors over (none: whole)."""
    return {tuple(p.device_mesh.mesh_dim_names) for p in model.parameters()
            if hasattr(p, "device_mesh")}


def whole_state(run: Any, model: nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of the model's whole state: gathered under a sharded layout,
    a pipeline stage's own part otherwise."""
    strategy = run.strategy
    state = (strategy.full_state_dict(model) if isinstance(strategy, ShardedState)
             else strategy.unwrap(model).state_dict())
    return {k: v.detach().clone() for k, v in state.items()}
