"""Named layouts (``fsdp``, ``zero2``, ``tp``, ``fsdp_tp``, ``pipeline``, ``hybrid``) as
entries of the strategy table: each expands its ``strategy_options`` into a
:class:`~paratrain.parallel.Parallel` (:func:`paratrain.parallel.presets.preset`) and
returns the :class:`~.strategy.LayoutStrategy` that runs it, named after the preset, so
every existing script and checkpoint keeps its name and runs the one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paratrain.distributed.topology import Topology
from paratrain.parallel.degrees import Parallel, describe
from paratrain.parallel.presets import PRESET_OPTIONS, preset
from paratrain.strategies.layout.strategy import LayoutStrategy

__all__ = ["FSDP", "FSDP_TP", "HYBRID", "LayoutPreset", "PIPELINE", "TP", "ZERO2",
           "build_layout"]


def build_layout(topology: Topology, layout: Parallel, *, name: str,
                 timeout_s: float = 300.0) -> LayoutStrategy:
    """The layout strategy for ``layout`` on this job, called ``name``."""
    degrees = layout.resolve(world_size=topology.world_size,
                             local_world_size=topology.local_world_size,
                             replica_groups=topology.replica_groups)
    cls = LayoutStrategy
    if layout.semi_sync is not None:  # replicas that sync every H steps
        from paratrain.strategies.semisync.strategy import SemiSyncStrategy

        cls = SemiSyncStrategy
    strategy = cls(topology, layout, degrees, name=name, timeout_s=timeout_s)
    if name in _NAMES_MORE or degrees.context_degree > 1 or degrees.expert_degree > 1:
        # The name alone does not say the degrees: print them at start.
        strategy.layout_line = f"strategy {name!r}: {describe(degrees)}"
    return strategy


_NAMES_MORE = ("hybrid", "fsdp_tp")
"""Presets whose name stands for several layouts."""


@dataclass(frozen=True, kw_only=True)
class LayoutPreset:
    """A strategy name whose options expand to a layout, called like a strategy class:
    ``preset(topology, options, timeout_s=...)`` returns the :class:`LayoutStrategy`.

    Example:
        >>> FSDP.Options(reshard_after_forward=False).reshard_after_forward
        False
    """

    name: str
    """What ``Run(strategy=...)`` calls it."""

    @property
    def Options(self) -> type:  # noqa: N802  (read like a strategy class's Options)
        """Its ``strategy_options`` dataclass (validated on construction)."""
        return PRESET_OPTIONS[self.name]

    def __call__(self, topology: Topology, options: Any = None, *,
                 timeout_s: float = 300.0) -> LayoutStrategy:
        layout = preset(self.name, options if options is not None else self.Options(),
                        local_world_size=topology.local_world_size)
        if not topology.is_distributed:
            layout = Parallel()  # one process: nothing to split (the notice says so)
        return build_layout(topology, layout, name=self.name, timeout_s=timeout_s)


FSDP = LayoutPreset(name="fsdp")
ZERO2 = LayoutPreset(name="zero2")
TP = LayoutPreset(name="tp")
FSDP_TP = LayoutPreset(name="fsdp_tp")
PIPELINE = LayoutPreset(name="pipeline")
HYBRID = LayoutPreset(name="hybrid")
