"""The narrow interface every parallel strategy implements.

The training loop only ever talks to this interface, so adding a strategy
(parameter server, FSDP, pipeline, ...) never changes the loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed.topology import Topology

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@dataclass(frozen=True, kw_only=True)
class NoOptions:
    """A strategy without options."""


class Strategy:
    """Base class: one process, no communication. Subclasses override what differs.

    Args:
        topology: the process's place in the job, validated already.
        options: the strategy's own options dataclass (``Options``).
    """

    name: ClassVar[str] = "base"
    Options: ClassVar[type] = NoOptions
    replicated: ClassVar[bool] = True
    """Every data-parallel rank holds the full model: rank 0 alone writes checkpoints."""
    timeout_s: float = 300.0
    """Seconds to wait for a peer before failing; the Run sets it from ``RunConfig.timeout_s``."""

    def __init__(self, topology: Topology, options: Any = None) -> None:
        self.topology = topology
        self.options = options if options is not None else self.Options()

    # -- data-parallel layout: which shard of the data this rank reads --------
    @property
    def data_parallel_rank(self) -> int:
        return self.topology.rank

    @property
    def data_parallel_size(self) -> int:
        return self.topology.world_size

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """Group over which metrics are reduced; None means the default (world) group."""
        return None

    # -- model and optimizer --------------------------------------------------
    def setup_model(self, model: nn.Module) -> nn.Module:
        """Move ``model`` to the device and wrap it for this strategy."""
        return model.to(self.topology.device)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        return optimizer

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper ``setup_model`` added."""
        return model

    def configure_precision(self, precision: Any) -> None:
        """Adopt the run's :class:`~paratrain.precision.Precision` (e.g. FSDP's dtype policy).

        Called once, before ``setup_model``; raise ValueError for an unsupported mode.
        """

    def evaluation_batches(self, batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        """Yield ``(batch, counted)``; strategies with collectives in forward pad with
        uncounted batches so that every rank runs the same number of forwards."""
        for batch in batches:
            yield batch, True

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Context in which forward and backward accumulate gradients without communicating."""
        return contextlib.nullcontext()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the global L2 norm of all gradients; gradients are already synchronised."""
        return nn.utils.clip_grad_norm_(self.unwrap(model).parameters(), max_norm)

    # -- checkpoints ----------------------------------------------------------
    def model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        self.unwrap(model).load_state_dict(state)

    def optimizer_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        return optimizer.state_dict()

    def load_optimizer_state_dict(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
    ) -> None:
        """Load ``optimizer.state_dict()`` layout; strategies that are not ``replicated``
        receive it keyed by parameter name instead of index."""
        optimizer.load_state_dict(state)

    def checkpoint_module(self, model: nn.Module) -> nn.Module:
        """The module whose (fully-qualified) state a sharded checkpoint stores."""
        return self.unwrap(model)

    @property
    def partial_model(self) -> bool:
        """This rank holds only some of the model's parameters (a pipeline stage)."""
        return False

    def save_sharded_state(self, directory: str, models: list[nn.Module],
                           optimizers: list[torch.optim.Optimizer]) -> None:
        """Write models and optimizers with ``torch.distributed.checkpoint`` (collective).

        Used instead of the single-file path when the strategy is not ``replicated``.
        """
        from paratrain.checkpoint.sharded import save_sharded

        save_sharded(directory, [self.checkpoint_module(m) for m in models], optimizers)

    def load_sharded_state(self, directory: str, models: list[nn.Module],
                           optimizers: list[torch.optim.Optimizer], *,
                           flat_optimizer: bool = True) -> None:
        """Load what :meth:`save_sharded_state` wrote, at any world size (collective).

        ``flat_optimizer`` is False for checkpoints whose optimizer state is nested
        (written before the flat layout).
        """
        from paratrain.checkpoint.sharded import load_sharded

        load_sharded(directory, [self.checkpoint_module(m) for m in models], optimizers,
                     flat=flat_optimizer)

    # -- collectives over the data-parallel group ------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` (a copy) across data-parallel ranks; ``op`` is sum, mean, max or min."""
        result = tensor.detach().clone()
        if self.data_parallel_size > 1:
            reduce_op = _REDUCE_OPS["sum" if op == "mean" else op]
            dist.all_reduce(result, op=reduce_op, group=self.data_parallel_group)
        if op == "mean":
            result = result / self.data_parallel_size
        return result

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Stack ``tensor`` from every data-parallel rank along a new first dimension."""
        tensor = tensor.detach().contiguous()
        if self.data_parallel_size == 1:
            return tensor.unsqueeze(0)
        parts = [torch.empty_like(tensor) for _ in range(self.data_parallel_size)]
        dist.all_gather(parts, tensor, group=self.data_parallel_group)
        return torch.stack(parts)

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

    def notice(self) -> str | None:
        """One line rank 0 prints once the run is set up (the layout chosen), or None."""
        return None

    def metrics(self) -> dict[str, Any]:
        """Strategy-specific values added to each epoch's metrics (rank 0 logs them)."""
        return {}

    # -- lifetime -------------------------------------------------------------
    def serve(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        """Run a non-training role (e.g. a parameter server) to completion.

        Returns True if this rank had such a role and the user's loop must not run.
        """
        return False

    def teardown(self) -> None:
        """Release wrapped modules and groups so the process group can be destroyed."""
