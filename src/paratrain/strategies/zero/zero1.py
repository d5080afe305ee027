"""``zero1``: DDP with the optimizer state sharded over the ranks (ZeRO stage 1).

Gradients are all-reduced by ``DistributedDataParallel`` exactly as under ``ddp``,
so every rank holds the whole averaged gradient (clipping sees the global norm
locally). The user's optimizer is rebuilt as a
``torch.distributed.optim.ZeroRedundancyOptimizer`` of the same class: each rank
keeps the state of, and updates, only its share of the parameters, then
broadcasts them. Adam's two moments thus cost 2/N of the parameters per rank
instead of 2x.

Checkpoints are one file in the ordinary ``optimizer.state_dict()`` layout
(the shards are gathered on rank 0 when saving), so ``ddp`` and ``zero1``
resume each other's checkpoints.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from paratrain.checkpoint.sharded import constructor_defaults
from paratrain.strategies.ddp import DDPOptions, DDPStrategy


def shard_optimizer(optimizer: torch.optim.Optimizer) -> ZeroRedundancyOptimizer:
    """A ``ZeroRedundancyOptimizer`` of ``optimizer``'s class, groups and hyperparameters.

    Called right after construction: optimizer *state* is not carried over, and a
    non-empty state is refused rather than silently dropped.
    """
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return optimizer
    if any(optimizer.state.values()):
        raise ValueError("strategy 'zero1' shards the optimizer state at run.prepare(); "
                         "pass an optimizer that has not stepped yet and load state with "
                         "run.load()")
    groups = [dict(group) for group in optimizer.param_groups]
    return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                   **constructor_defaults(optimizer))


class Zero1Strategy(DDPStrategy):
    """Replicated parameters and gradients, optimizer state sharded (ZeRO-1).

    Options are ``ddp``'s (:class:`~paratrain.strategies.ddp.DDPOptions`).
    """

    name = "zero1"
    Options = DDPOptions

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if not self.topology.is_distributed:
            return optimizer
        return shard_optimizer(optimizer)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer.state_dict()
        # Collective: every rank sends its shard's state to rank 0, which writes the file.
        optimizer.consolidate_state_dict(to=0)
        return optimizer.state_dict() if self.topology.rank == 0 else {}

    def load_optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                  state: dict[str, Any]) -> None:
        # The whole layout; ZeroRedundancyOptimizer keeps this rank's part of it.
        optimizer.load_state_dict(state)
