"""The core contract every parallel strategy implements.

The training loop only ever talks to this contract, so adding a strategy
(parameter server, FSDP, pipeline, ...) never changes the loop. What only some
strategies do (sharded checkpoints, a server role, lockstep evaluation, a
precision policy, metrics of their own) is declared with the small mix-ins of
:mod:`paratrain.strategies.capabilities` and asked for with ``isinstance``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed._compat import all_gather_single
from paratrain.distributed.dtensor import whole
from paratrain.distributed.topology import Topology
from paratrain.strategies.clipping import clip_grad_norm

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass(frozen=True, kw_only=True)
class NoOptions:
    """A strategy without options."""


class Strategy:
    """The core contract, with the defaults of one process without communication.

    Subclasses override what differs and inherit capability mix-ins for the rest.

    Args:
        topology: the process's place in the job, validated already.
        options: the strategy's own options dataclass (``Options``).
        timeout_s: seconds to wait for a peer before failing (``RunConfig.timeout_s``).
    """

    name: ClassVar[str] = "base"
    Options: ClassVar[type] = NoOptions
    CONFIGURATION: ClassVar[tuple[str, ...]] = ("name", "Options", "CONFIGURATION",
                                                "layout_line")
    """Class-level settings: not members a strategy implements."""
    layout_line: str | None = None
    """The degrees a preset built this strategy for, printed at start (see ``notice``)."""

    def __init__(self, topology: Topology, options: Any = None, *,
                 timeout_s: float = 300.0) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.topology = topology
        self.options = options if options is not None else self.Options()
        self.timeout_s = timeout_s

    def notice(self) -> str | None:
        """One line the run prints at start (e.g. a fallback to ``single``), or None."""
        return self.layout_line

    # -- data-parallel layout: which shard of the data this rank reads --------
    @property
    def data_parallel_rank(self) -> int:
        return self.topology.rank

    @property
    def data_parallel_size(self) -> int:
        return self.topology.world_size

    @property
    def random_stream_rank(self) -> int:
        """The rank whose random stream this rank draws from after ``prepare`` (dropout).

        Tensor-parallel peers share one: between the split layers they hold the same
        activations, and different dropout masks there would make their copies drift.
        """
        return self.topology.rank

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The *batch* group: the ranks that read different data; None means the default
        (world) group."""
        return None

    # -- losses and metrics: averaged over the loss group ----------------------
    @property
    def loss_size(self) -> int:
        """Ranks over which losses and metrics are averaged: the batch ranks, times the
        context-parallel ranks (each holds a slice of the same samples)."""
        return self.data_parallel_size

    @property
    def loss_group(self) -> dist.ProcessGroup | None:
        """The *loss* group (see :attr:`loss_size`); None means the default (world) group."""
        return self.data_parallel_group

    def local_batch(self, batch: Any) -> Any:
        """This rank's part of a loaded batch (context parallel: a slice of each sequence)."""
        return batch

    def mean_loss_factor(self) -> float:
        """What a mean loss of the last batch is multiplied by before backward, so that its
        average over the loss group is the mean over every element (1.0: nothing to do)."""
        return 1.0

    # -- model and optimizer --------------------------------------------------
    def setup_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device and wrap it for this strategy."""
        return model.to(self.topology.device)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper ``setup_model`` added."""
        return model

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context in which forward and backward accumulate gradients without communicating."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the global L2 norm of all gradients (synchronised already) over any
        mesh (:func:`~paratrain.strategies.clipping.clip_grad_norm`); return that norm."""
        return clip_grad_norm(self.unwrap(model).parameters(), max_norm)

    # -- one-file checkpoints (every strategy loads them; replicated ones write them) --
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        """The model's full state, written by rank 0 (may be collective)."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        self.unwrap(model).load_state_dict(state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        """Load ``optimizer.state_dict()`` layout; :class:`~paratrain.strategies.capabilities.
        ShardedState` strategies receive it keyed by parameter name instead of index."""
        optimizer.load_state_dict(state)

    # -- collectives over the data-parallel group ------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` (a copy) across the loss group; ``op`` is sum, mean, max or min."""
        # whole(): a loss over vocabulary-sharded logits (tp's loss_parallel) is a DTensor.
        result = whole(tensor).detach().clone()
        if self.loss_size > 1:
            reduce_op = _REDUCE_OPS["sum" if op == "mean" else op]
            dist.all_reduce(result, op=reduce_op, group=self.loss_group)
        if op == "mean":
            result = result / self.loss_size
        return result

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack ``tensor`` from every rank of the loss group along a new first dimension."""
        tensor = whole(tensor).detach().contiguous()
        if self.loss_size == 1:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.loss_size)]
        dist.all_gather(parts, tensor, group=self.loss_group)
        return torch.stack(parts)

    def agree_flags(self, flags: torch.Tensor) -> torch.Tensor:
        """``flags`` (a small integer tensor) of every rank that steps together with this
        one, stacked (collective): what the run's non-finite check gathers once per
        optimizer step so that all those ranks take the same decision. All ranks by
        default: pipeline stages and tensor-parallel peers step together too."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return flags.unsqueeze(0)
        gathered = flags.new_empty(dist.get_world_size() * flags.numel())
        all_gather_single(gathered, flags.reshape(-1).contiguous(), None)
        return gathered.view(-1, *flags.shape)

    def barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def gather_rng_states(self, blob: torch.Tensor) -> torch.Tensor:
        """Every checkpointing rank's RNG ``blob``, stacked by global rank (collective)."""
        if not dist.is_initialized():
            return blob.unsqueeze(0)
        parts = [torch.empty_like(blob) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, blob)
        return torch.stack(parts)

    # -- lifetime -------------------------------------------------------------
    def teardown(self) -> None:
        """Release wrapped modules and groups so the process group can be destroyed."""
