"""Parallel strategies, by name. Each lives in its own module behind :class:`Strategy`;
the names, and how to build each, are :mod:`paratrain.strategies.table`."""

from __future__ import annotations

import dataclasses
from typing import Any

from paratrain.distributed.topology import Topology
from paratrain.fieldtypes import check_types
from paratrain.strategies.base import Strategy
from paratrain.strategies.table import strategy_entry, strategy_names


def available_strategies() -> list[str]:
    """Names accepted by ``Run(strategy=...)``, plus ``auto``."""
    return sorted(strategy_names())


def strategy_class(name: str) -> Any:
    """The class (or layout preset) registered under ``name``; ValueError naming the
    choices otherwise.

    The class's module is imported only now (see :mod:`paratrain.strategies.table`).
    """
    return strategy_entry(name).load_class()


def resolve_name(name: str, topology: Topology) -> str:
    """``auto`` means ``ddp`` for a multi-process job and ``single`` otherwise."""
    if name == "auto":
        return "ddp" if topology.is_distributed else "single"
    return name


def create_strategy(name: str, topology: Topology, options: dict[str, Any] | None = None, *,
                    timeout_s: float = 300.0, layout: Any = None) -> Strategy:
    """Build the strategy ``name`` with its options validated by its ``Options`` dataclass;
    ``timeout_s`` bounds every wait for a peer. With ``layout`` (a
    :class:`~paratrain.parallel.Parallel`), the layout strategy runs it, called ``name``."""
    if layout is not None:
        from paratrain.strategies.layout.presets import build_layout

        return build_layout(topology, layout, name=name, timeout_s=timeout_s)
    cls = strategy_class(resolve_name(name, topology))
    options = dict(options or {})
    known = {f.name for f in dataclasses.fields(cls.Options)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(
            f"strategy_options has unknown field(s) {unknown} for strategy {cls.name!r}; "
            f"known: {sorted(known) or 'none'}"
        )
    # Types before the options' own checks, which assume them (one line, not a traceback).
    check_types(cls.Options, options,
                label=lambda field: f"strategy_options[{field!r}] of strategy {cls.name!r}")
    return cls(topology, cls.Options(**options), timeout_s=timeout_s)


__all__ = ["Strategy", "available_strategies", "create_strategy", "resolve_name", "strategy_class"]
