"""The layout strategy with a semi-synchronous replicate axis.

:func:`~paratrain.strategies.layout.presets.build_layout` returns a
:class:`SemiSyncStrategy` when the layout has ``semi_sync``: everything is the layout
strategy's (the one order, FSDP over ``shard x context`` only, as
:func:`~paratrain.strategies.layout.apply.parallelize` decides from the layout), plus
the outer sync around the optimizer step and the outer state in sharded checkpoints.

Its optimizer step is not plain ``optimizer.step()``: a compiled optimizer step
(``compile["optimizer"]``) sees a strategy with its own step and keeps the eager one.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future
from typing import Any

import torch
from torch import nn

from paratrain.checkpoint.sharded import load_sharded, save_sharded, start_save_sharded
from paratrain.distributed._compat import all_gather_single
from paratrain.strategies.layout.strategy import LayoutStrategy
from paratrain.strategies.semisync.fragments import fragment_parameters, unit_names
from paratrain.strategies.semisync.outer import OuterSync
from paratrain.strategies.semisync.resume import load_rank_state, save_rank_state

__all__ = ["SemiSyncStrategy", "describe_semi_sync"]


def describe_semi_sync(mode: Any) -> str:
    """``DiLoCo every 50 steps (outer lr 0.7, Nesterov momentum 0.9, 2 fragments)``."""
    what = f"{type(mode).__name__} every {mode.every} step{'s' if mode.every != 1 else ''}"
    if not hasattr(mode, "outer_lr"):
        return what
    momentum = ("no momentum" if mode.outer_momentum == 0 else
                f"{'Nesterov ' if mode.nesterov else ''}momentum {mode.outer_momentum:g}")
    extra = [f"outer lr {mode.outer_lr:g}", momentum]
    if mode.fragments > 1:
        extra.append(f"{mode.fragments} fragments")
    if mode.overlap:
        extra.append("overlapped")
    if mode.comm_dtype:
        extra.append(f"sent in {mode.comm_dtype}")
    return f"{what} ({', '.join(extra)})"


class SemiSyncStrategy(LayoutStrategy):
    """A :class:`LayoutStrategy` whose replica groups synchronise every H steps."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outer: OuterSync | None = None
        """The outer state and step, once the optimizer is prepared."""
        self._units: list[list[str]] = []
        self._optimizer: torch.optim.Optimizer | None = None
        self._groups: Any = None

    def replicate_through(self, rounds: Any) -> None:
        """Fault tolerant: the replicas are torchft's replica groups, met at each outer sync
        through ``rounds`` (:class:`~paratrain.fault_tolerance.rounds.OuterRounds`), not
        the mesh's ``replicate`` group (of size 1 inside a group)."""
        self._groups = rounds

    @property
    def semi_sync(self) -> Any:
        return self.layout.semi_sync

    def notice(self) -> str | None:
        line = super().notice() or f"strategy {self.name!r}"
        groups = (f"{self.topology.replica_groups} fault-tolerant"
                  if self.topology.replica_groups > 1 else self.degrees.replicate_degree)
        return (f"{line}; {groups} replica groups, "
                f"{describe_semi_sync(self.semi_sync)}")

    # -- set-up ---------------------------------------------------------------------
    def setup_model(self, model: nn.Module) -> nn.Module:
        # Units before parallelizing: FSDP renames the classes a wrap policy may name.
        sharding = self.layout.sharding
        self._units = unit_names(model, sharding.wrap_policy if sharding else None)
        return super().setup_model(model)

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer = super().setup_optimizer(optimizer)
        if self.outer is not None:
            raise ValueError(f"semi_sync={type(self.semi_sync).__name__} takes its outer step "
                             "over one optimizer's parameters; prepare one model with one "
                             "optimizer")
        fragments = fragment_parameters(self._units, self._params, optimizer,
                                        getattr(self.semi_sync, "fragments", 1))
        # Fault tolerant: the groups are met through torchft, not a replicate process group.
        replicate = self.mesh.group("replicate") if self._groups is None else None
        self.outer = OuterSync(self.semi_sync, fragments, group=replicate,
                               replicas=self.degrees.replicate_degree,
                               device=self.topology.device, groups=self._groups)
        if self._groups is not None:
            self._groups.attach(self.outer)
        self._optimizer = optimizer
        return optimizer

    # -- the step -------------------------------------------------------------------
    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        outer = self.outer if optimizer is self._optimizer else None
        if outer is not None:
            outer.before_step()
        super().optimizer_step(optimizer)
        if outer is not None:
            outer.after_step()

    def agree_flags(self, flags: torch.Tensor) -> torch.Tensor:
        """The flags of this rank's replica group only: the groups step alone between
        outer syncs, and a per-step collective across them would cost a round trip of
        the slow link semi_sync is for (each group decides its non-finite steps)."""
        if self.degrees.replicate_degree == self.topology.world_size:
            return flags.unsqueeze(0)
        group = self.mesh.replica_peers_group
        size = self.topology.world_size // self.degrees.replicate_degree
        gathered = flags.new_empty(size * flags.numel())
        all_gather_single(gathered, flags.reshape(-1).contiguous(), group)
        return gathered.view(-1, *flags.shape)

    # -- checkpoints ----------------------------------------------------------------
    def _save_rank_state(self, directory: str) -> None:
        if self.outer is not None:
            save_rank_state(directory, self.outer, self._optimizer, rank=self.topology.rank,
                            world_size=self.topology.world_size)

    def save_sharded_state(self, directory: str, models: list[nn.Module],
                           optimizers: list[torch.optim.Optimizer]) -> None:
        self._save_rank_state(directory)
        save_sharded(directory, [self.checkpoint_module(m) for m in models], optimizers,
                     lowest_rank=True)

    def start_sharded_save(self, directory: str, models: list[nn.Module],
                           optimizers: list[torch.optim.Optimizer], *, group: Any) -> Future:
        self._save_rank_state(directory)  # small next to the shards: written now
        save = functools.partial(start_save_sharded, lowest_rank=True)
        return save(directory, [self.checkpoint_module(m) for m in models], optimizers,
                    group=group)

    def load_sharded_state(self, directory: str, models: list[nn.Module],
                           optimizers: list[torch.optim.Optimizer], *,
                           flat_optimizer: bool = True) -> None:
        load_sharded(directory, [self.checkpoint_module(m) for m in models], optimizers,
                     flat=flat_optimizer)
        if self.outer is not None:
            load_rank_state(directory, self.outer, self._optimizer, rank=self.topology.rank,
                            world_size=self.topology.world_size)

    def teardown(self) -> None:
        if self.outer is not None:
            self.outer.wait()  # no all-reduce left in flight when the group goes
        super().teardown()
