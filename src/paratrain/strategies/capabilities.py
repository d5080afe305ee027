"""Optional capabilities of a strategy, each a small abstract mix-in.

The core :class:`~paratrain.strategies.base.Strategy` is what every strategy
does. What only some strategies do is declared by inheriting one of these
classes, and callers ask with ``isinstance(strategy, Capability)``, never by
the concrete strategy class nor by probing for attributes:

* :class:`ShardedState`: no rank holds the whole model, checkpoints are written
  by every rank through ``torch.distributed.checkpoint`` (``fsdp``,
  ``pipeline``, ``hybrid``, ``tp``, ``fsdp_tp``).
* :class:`ServerRole`: some ranks serve instead of training (``ps``).
* :class:`LockstepEvaluation`: forward is collective, so evaluation pads with
  uncounted batches (``fsdp``).
* :class:`PrecisionPolicy`: the strategy adopts the run's precision itself
  (``fsdp``'s dtype policy) or refuses modes it cannot honour.
* :class:`ReportsMetrics`: values added to each epoch's metrics (``ps``).
* :class:`Compiles`: applies ``torch.compile`` at the right point of its set-up
  (``single``, ``ddp``, ``fsdp``, ``hybrid``; ``pipeline`` in one process only).

Example:
    >>> from paratrain.strategies.capabilities import ShardedState
    >>> if isinstance(run.strategy, ShardedState):  # doctest: +SKIP
    ...     state = run.strategy.full_state_dict(model)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from concurrent.futures import Future

    from paratrain.compile import CompileOptions
    from paratrain.precision import Precision
    from paratrain.strategies.base import Strategy


class ShardedState(ABC):
    """Each rank holds part of the model or its state; checkpoints are sharded.

    The defaults suit a strategy whose wrapped module keeps the user's names
    (FSDP's DTensors); a pipeline stage overrides :meth:`checkpoint_module` and
    :attr:`partial_model`.
    """

    def checkpoint_module(self, model: nn.Module) -> nn.Module:
        """The module whose (fully-qualified) state a sharded checkpoint stores."""
        return self.unwrap(model)  # type: ignore[attr-defined]

    @property
    def partial_model(self) -> bool:
        """This rank holds only some of the model's parameters (a pipeline stage)."""
        return False

    def save_sharded_state(self, directory: str, models: list[nn.Module],
                           optimizers: list[torch.optim.Optimizer]) -> None:
        """Write models and optimizers with ``torch.distributed.checkpoint`` (collective)."""
        from paratrain.checkpoint.sharded import save_sharded

        save_sharded(directory, [self.checkpoint_module(m) for m in models], optimizers)

    def start_sharded_save(self, directory: str, models: list[nn.Module],
                           optimizers: list[torch.optim.Optimizer], *,
                           group: Any) -> Future:
        """Like :meth:`save_sharded_state`, but only the copy to the CPU happens now; the
        write runs on a thread whose collectives use ``group``. Returns its future."""
        from paratrain.checkpoint.sharded import start_save_sharded

        return start_save_sharded(directory, [self.checkpoint_module(m) for m in models],
                                  optimizers, group=group)

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

    @abstractmethod
    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's state on every rank (collective), e.g. to export it."""


class ServerRole(ABC):
    """Some ranks run a non-training role (a parameter server) instead of the loop."""

    @abstractmethod
    def serve(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
        """Run this rank's non-training role to completion, if it has one.

        Called by ``run.prepare`` after setup on every rank. Returns True if this rank
        served and the user's loop must not run.
        """


class LockstepEvaluation(ABC):
    """Forward is collective: every rank must run the same number of forwards."""

    @abstractmethod
    def evaluation_batches(self, batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
        """Yield ``(batch, counted)``, padding with uncounted batches so that every rank
        runs as many forwards as the rank with the most batches."""


class PrecisionPolicy(ABC):
    """The strategy applies the run's precision itself or restricts the modes."""

    @abstractmethod
    def configure_precision(self, precision: Precision) -> None:
        """Adopt ``precision``; called once, before ``setup_model``.

        Raises ValueError for a mode the strategy cannot honour.
        """


class ReportsMetrics(ABC):
    """The strategy has values of its own for each epoch's metrics."""

    @abstractmethod
    def metrics(self) -> dict[str, Any]:
        """Values added to the epoch's metrics (rank 0 logs them)."""


# Declared by inheriting, like the others, though nothing in it is left abstract.
class Compiles(ABC):  # noqa: B024
    """The strategy applies ``torch.compile`` in ``setup_model`` where its wrapping needs
    it: after activation checkpointing, inside DDP, per block before FSDP.

    :meth:`configure_compile` stores the options in ``_compile`` for ``setup_model``;
    a strategy that refuses some settings checks them first, then calls it.
    """

    _compile: CompileOptions | None = None

    def configure_compile(self, options: CompileOptions) -> None:
        """Compile with ``options`` in the next ``setup_model``; called once before it."""
        self._compile = options

    def cuda_graphs_blocker(self) -> str | None:
        """Why this strategy's compiled steps cannot be CUDA graphs, or None."""
        return None


# A marker, like Compiles: nothing in it is abstract.
class ShardsOnMeta(ABC):  # noqa: B024
    """``setup_model`` takes a model whose parameters are on the meta device, shards it,
    and gives memory to this rank's shards only (``fsdp``, ``hybrid``); other strategies
    receive such a model materialised whole (see :mod:`paratrain.checkpoint.meta_init`)."""

    def shards_on_meta(self) -> bool:
        """Whether this layout shards on meta (one that cuts real weights does not)."""
        return True


class OrdersParallelisms(ABC):
    """The strategy applies activation checkpointing itself, at its place in the one
    order of a layout (after tensor, context and expert parallel, before compile and
    FSDP); for other strategies the run applies it before ``setup_model``."""

    @abstractmethod
    def configure_activation_checkpointing(self, spec: Any) -> None:
        """Recompute what ``spec`` names (``RunConfig.checkpoint_activations``) in the
        next ``setup_model``."""


CAPABILITIES: tuple[type, ...] = (ShardedState, ServerRole, LockstepEvaluation, PrecisionPolicy,
                                  ReportsMetrics, Compiles, ShardsOnMeta, OrdersParallelisms)
"""Every optional capability, for tools that list what a strategy offers."""


def local_module(strategy: Strategy, model: nn.Module) -> nn.Module:
    """This rank's module as a checkpoint stores it: its shard or stage, else the whole
    unwrapped model."""
    if isinstance(strategy, ShardedState):
        return strategy.checkpoint_module(model)
    return strategy.unwrap(model)


def evaluation_batches(strategy: Strategy, batches: Iterable[Any]) -> Iterator[tuple[Any, bool]]:
    """``(batch, counted)`` pairs: padded for :class:`LockstepEvaluation`, else all counted."""
    if isinstance(strategy, LockstepEvaluation):
        return strategy.evaluation_batches(batches)
    return ((batch, True) for batch in batches)


def strategy_metrics(strategy: Strategy) -> dict[str, Any]:
    """The strategy's own epoch metrics (:class:`ReportsMetrics`), else none."""
    return strategy.metrics() if isinstance(strategy, ReportsMetrics) else {}


def require_compile(strategy: Strategy) -> Compiles:
    """``strategy`` as :class:`Compiles`; a one-line ValueError when it cannot compile."""
    if not isinstance(strategy, Compiles):
        raise ValueError(f"compile is not supported with strategy {strategy.name!r}; "
                         "use compile=False or one of single, ddp, fsdp, hybrid")
    return strategy
