"""A named layout that is not a strategy of its own: a preset that builds one.

``hybrid`` names layouts (pipeline x data parallel, HSDP) that the ``pipeline`` and
``fsdp`` strategies already run when given their degrees. Rather than a composite that
forwards every contract member to an inner strategy, its table entry is a
:class:`LayoutPreset`: it validates the preset's options, turns them into degrees and
returns the strategy that runs those degrees, so there is one implementation of each
layout and nothing to forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from paratrain.distributed.mesh import ParallelDegrees
from paratrain.distributed.topology import Topology

__all__ = ["LayoutPreset"]


@dataclass(frozen=True, kw_only=True)
class LayoutPreset:
    """A strategy name whose options resolve to degrees run by another strategy.

    Called like a strategy class, ``preset(topology, options, timeout_s=...)``, it returns
    that other strategy, named after the preset and announcing its degrees.

    Example:
        >>> from paratrain.strategies.hybrid import HYBRID       # doctest: +SKIP
        >>> HYBRID(topology, HYBRID.Options(pipeline_degree=2)).name
        'hybrid'
    """

    name: str
    """What ``Run(strategy=...)`` calls it."""

    Options: type
    """Its options dataclass (validated on construction)."""

    build: Callable[[Topology, Any, float], tuple[Any, ParallelDegrees]]
    """``(topology, options, timeout_s) -> (strategy, degrees)``."""

    def __call__(self, topology: Topology, options: Any = None, *,
                 timeout_s: float = 300.0) -> Any:
        strategy, degrees = self.build(topology, options if options is not None
                                       else self.Options(), timeout_s)
        # The run, its checkpoints and its messages know the layout by the name asked for.
        strategy.name = self.name
        strategy.layout_line = (
            f"strategy {self.name!r}: pipeline {degrees.pipeline_degree} x replicate "
            f"{degrees.replicate_degree} x shard {degrees.shard_degree} x tensor "
            f"{degrees.tensor_degree}")
        return strategy
