"""The strategy table: one entry per strategy, read by ``Run``, ``paratrain bench`` and
``paratrain plan``, so the three always agree on which strategies exist.

An entry says how to build the strategy (``module:Class``), how the planner costs it (a
cost model in :mod:`paratrain.plan.costs`, or why it has none) and what the bench needs to
know to launch it. Both references are strings, imported only when used: choosing
``ddp`` never imports the parameter server, and the runtime never imports the planner.
The order of :data:`STRATEGY_TABLE` is the planner's report order and its tie-break
order (simplest first).

Example::

    >>> from paratrain.strategies.table import strategy_entry
    >>> entry = strategy_entry("ps")
    >>> entry.server_processes, entry.server_flag
    (1, '--ps-servers')
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

__all__ = ["STRATEGY_TABLE", "StrategyEntry", "load_reference", "strategy_entry", "strategy_names"]


def load_reference(reference: str) -> Any:
    """Import ``module:attribute`` and return the attribute."""
    module_name, sep, attribute = reference.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"expected 'module:attribute', got {reference!r}")
    return getattr(importlib.import_module(module_name), attribute)


@dataclass(frozen=True, kw_only=True)
class StrategyEntry:
    """Everything the runtime, the bench and the planner need to know about one strategy."""

    name: str
    """What ``Run(strategy=...)``, ``--strategies`` and the planner's rows call it."""

    target: str
    """``module:Class`` of the runtime strategy, or ``module:PRESET`` of a
    :class:`~paratrain.strategies.layout.presets.LayoutPreset` that builds one."""

    cost_model: str = ""
    """``module:attribute`` of its :class:`~paratrain.plan.costs.CostModel`; empty only
    together with :attr:`not_modelled`."""

    not_modelled: str = ""
    """Why the planner has no cost model: its row says so and it is never recommended."""

    single_process: bool = False
    """It trains in one process; several processes would train unrelated copies."""

    server_processes: int = 0
    """Processes the launcher starts beside the training ranks (parameter servers)."""

    server_flag: str = ""
    """The launcher flag that sets :attr:`server_processes`."""

    gpu_bench_precisions: tuple[str, ...] = ()
    """Precisions at which ``paratrain bench`` measures it by default on a CUDA machine."""

    def __post_init__(self) -> None:
        if bool(self.cost_model) == bool(self.not_modelled):
            raise ValueError(f"strategy {self.name!r}: give exactly one of cost_model and "
                             "not_modelled")
        if bool(self.server_processes) != bool(self.server_flag):
            raise ValueError(f"strategy {self.name!r}: server_processes and server_flag go "
                             "together")

    @property
    def modelled(self) -> bool:
        """Whether the planner predicts it."""
        return bool(self.cost_model)

    def load_class(self) -> type:
        """The runtime strategy class (imports its module)."""
        return load_reference(self.target)

    def load_cost_model(self) -> Any:
        """The planner's cost model (imports :mod:`paratrain.plan.costs`); ValueError if none."""
        if not self.modelled:
            raise ValueError(f"strategy {self.name!r} is not modelled: {self.not_modelled}")
        return load_reference(self.cost_model)


_RUNTIME = "paratrain.strategies"
_COSTS = "paratrain.plan.costs"

#: Every strategy, simplest first (the planner's report and tie-break order).
STRATEGY_TABLE: tuple[StrategyEntry, ...] = (
    StrategyEntry(name="single", target=f"{_RUNTIME}.single:SingleDevice",
                  cost_model=f"{_COSTS}:SINGLE", single_process=True,
                  gpu_bench_precisions=("32",)),
    StrategyEntry(name="ddp", target=f"{_RUNTIME}.ddp:DDPStrategy",
                  cost_model=f"{_COSTS}:DDP", gpu_bench_precisions=("32", "bf16-mixed")),
    StrategyEntry(name="zero1", target=f"{_RUNTIME}.zero.zero1:Zero1Strategy",
                  cost_model=f"{_COSTS}:ZERO1"),
    StrategyEntry(name="zero2", target=f"{_RUNTIME}.layout.presets:ZERO2",
                  cost_model=f"{_COSTS}:ZERO2"),
    StrategyEntry(name="fsdp", target=f"{_RUNTIME}.layout.presets:FSDP",
                  cost_model=f"{_COSTS}:FSDP", gpu_bench_precisions=("32",)),
    StrategyEntry(name="pipeline", target=f"{_RUNTIME}.layout.presets:PIPELINE",
                  cost_model=f"{_COSTS}:PIPELINE"),
    StrategyEntry(name="hybrid", target=f"{_RUNTIME}.layout.presets:HYBRID",
                  cost_model=f"{_COSTS}:HYBRID"),
    StrategyEntry(name="tp", target=f"{_RUNTIME}.layout.presets:TP",
                  cost_model=f"{_COSTS}:TP"),
    StrategyEntry(name="fsdp_tp", target=f"{_RUNTIME}.layout.presets:FSDP_TP",
                  cost_model=f"{_COSTS}:FSDP_TP"),
    StrategyEntry(name="ps", target=f"{_RUNTIME}.ps.strategy:PSStrategy",
                  cost_model=f"{_COSTS}:PS", server_processes=1, server_flag="--ps-servers"),
    StrategyEntry(name="dp", target=f"{_RUNTIME}.dp:DataParallelStrategy",
                  cost_model=f"{_COSTS}:DP", single_process=True,
                  gpu_bench_precisions=("32",)),
    StrategyEntry(name="mp", target=f"{_RUNTIME}.model_parallel:ModelParallelStrategy",
                  cost_model=f"{_COSTS}:MP", single_process=True),
)


def strategy_names() -> tuple[str, ...]:
    """Names in table order."""
    return tuple(entry.name for entry in STRATEGY_TABLE)


def strategy_entry(name: str) -> StrategyEntry:
    """The entry called ``name``; ValueError naming the choices otherwise."""
    for entry in STRATEGY_TABLE:
        if entry.name == name:
            return entry
    choices = ", ".join(["auto", *sorted(strategy_names())])
    raise ValueError(f"unknown strategy {name!r}; choose one of: {choices}")
