"""Globally normalised losses: a summed loss divided by the count over all ranks and micro-steps.

A loss averaged per micro-batch (``F.cross_entropy(out, y)``) weights every
micro-batch equally. When micro-batches hold different numbers of valid tokens
(padding, ``ignore_index``) or different total sample weights, that is not the
mean over the global batch, and the result changes with the number of ranks
and the accumulation factor. The fix is to backpropagate the *sum* and divide
by the *global* count, which is only known once every rank has seen every
micro-batch of the accumulation group::

    loss_sum, count = paratrain.losses.token_cross_entropy(model(x), y)
    run.backward(loss_sum, count=count)      # divided by the global count at the step
    run.step(optimizer)

:class:`GlobalCount` does the bookkeeping for :meth:`paratrain.Run.backward`.
Because gradients are linear in the loss, dividing the synchronised gradient
by the global count at the optimizer step equals dividing the loss by it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from paratrain.strategies.base import Strategy


def sum_and_count(losses: torch.Tensor, *, mask: torch.Tensor | None = None,
                  weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of per-element ``losses`` and the count they stand for.

    ``mask`` (bool) keeps only some elements (e.g. non-padding tokens);
    ``weight`` weights each element, the count then being the total weight.
    """
    if mask is not None:
        mask = mask.to(losses.dtype)
        weight = mask if weight is None else weight * mask
    if weight is None:
        return losses.sum(), torch.tensor(float(losses.numel()), device=losses.device)
    weight = weight.to(losses.dtype)
    return (losses * weight).sum(), weight.sum().detach()


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *,
                        ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed cross-entropy over the targets that are not ``ignore_index``, and their count.

    ``logits`` is ``(..., num_classes)`` and ``targets`` is ``(...)``.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1]).float()
    flat_targets = targets.reshape(-1)
    loss_sum = F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index,
                               reduction="sum")
    return loss_sum, (flat_targets != ignore_index).sum().to(loss_sum.dtype)


class GlobalCount:
    """Counts of one accumulation group, turned into a gradient factor at the optimizer step.

    After the strategy's gradient synchronisation the gradient is the *mean* over
    the ``loss_size`` ranks (data x context parallel) of each rank's summed gradient.
    Multiplying it by ``loss_size / global_count`` gives the sum over all ranks and
    micro-steps divided by the global count.
    """

    def __init__(self) -> None:
        self._local: torch.Tensor | float = 0.0
        self._micro_steps = 0
        self._missing = 0

    @property
    def active(self) -> bool:
        """True when the current group's losses were passed with a count."""
        return self._micro_steps > 0

    def add(self, count: torch.Tensor | float | None) -> None:
        """Record one micro-step's local count (None: this micro-step gave none)."""
        if count is None:
            self._missing += 1
        elif isinstance(count, torch.Tensor):
            # Kept as a tensor: reading it now would wait for the device every micro-step.
            self._local = self._local + count.detach().double().sum()
            self._micro_steps += 1
        else:
            if count < 0:
                raise ValueError(f"count must be >= 0, got {count}")
            self._local += float(count)
            self._micro_steps += 1
        if self._micro_steps and self._missing:
            raise ValueError(
                "run.backward() got count= on some micro-steps of an accumulation group but "
                "not on others; pass count= on every micro-step or on none"
            )

    def gradient_factor(self, strategy: Strategy) -> float:
        """``loss_size / global_count``; one scalar all-reduce across the loss group."""
        local = torch.as_tensor(self._local, dtype=torch.float64).to(strategy.topology.device)
        total = float(strategy.all_reduce(local, "sum").item())
        # No valid element anywhere: the summed gradient is zero already.
        return strategy.loss_size / total if total > 0 else 0.0

    def reset(self) -> None:
        self._local = 0.0
        self._micro_steps = 0
        self._missing = 0
