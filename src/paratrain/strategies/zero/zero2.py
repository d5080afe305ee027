"""``zero2``: optimizer state and gradients sharded over the ranks (ZeRO stage 2).

Built as ``fsdp`` with ``reshard_after_forward=False``: a unit's parameters are
all-gathered once in forward and stay whole until its backward has run, so
backward gathers nothing; gradients are reduce-scattered and each rank updates
only its shard. Between steps the parameters are sharded again, so peak memory
holds whole parameters but 1/N of the gradients and optimizer state, and a step
moves the bytes of one all-gather plus one reduce-scatter (``ddp``'s all-reduce
volume).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paratrain.distributed.topology import Topology
from paratrain.strategies.fsdp import FSDPOptions, FSDPStrategy


@dataclass(frozen=True, kw_only=True)
class Zero2Options:
    """Options of the ``zero2`` strategy: ``fsdp``'s, less ``reshard_after_forward``."""

    wrap_policy: Any = None
    """Which submodules are their own unit (see ``FSDPOptions.wrap_policy``): units
    let one block's reduce-scatter overlap the next block's backward."""

    offload: bool = False
    """Keep sharded state in CPU memory (see ``FSDPOptions.offload``)."""

    def fsdp(self) -> FSDPOptions:
        """The ``fsdp`` options this strategy runs with (validates the fields)."""
        return FSDPOptions(wrap_policy=self.wrap_policy, offload=self.offload,
                           reshard_after_forward=False)

    def __post_init__(self) -> None:
        self.fsdp()


class Zero2Strategy(FSDPStrategy):
    """``fsdp`` with parameters kept whole between forward and backward (ZeRO-2).

    Everything else (sharded checkpoints, clipping by the global norm of the
    shards, lockstep evaluation, precision policy) is ``fsdp``'s.
    """

    name = "zero2"
    Options = Zero2Options

    def __init__(self, topology: Topology, options: Any = None, *,
                 timeout_s: float = 300.0) -> None:
        super().__init__(topology, (options or Zero2Options()).fsdp(), timeout_s=timeout_s)
