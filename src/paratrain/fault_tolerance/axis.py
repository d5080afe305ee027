"""This rank's replica axis: which of the fault-tolerance classes a run uses.

Without ``paratrain launch --fault-tolerant``: :class:`NoReplicaGroups` (nothing to
average, every step commits). With it: torchft's quorum every step
(:class:`~paratrain.fault_tolerance.quorum.ReplicaQuorum`), or, for a ``semi_sync``
layout, at its outer syncs only (:class:`~paratrain.fault_tolerance.rounds.OuterRounds`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from paratrain.fault_tolerance.options import resolve

if TYPE_CHECKING:
    from torch import nn

    from paratrain.data.loader import DataCursor
    from paratrain.fault_tolerance.quorum import ReplicaQuorum

__all__ = ["NoReplicaGroups", "replica_groups"]


class NoReplicaGroups:
    """A job without fault tolerance: one group, nothing to average, every step commits."""

    @property
    def uncommitted_steps(self) -> list[int]:
        return []  # every step commits

    def data_shard(self, rank: int, size: int) -> tuple[int, int]:
        return rank, size

    def notice(self) -> None:
        return None

    def join(self, state: Any, precision: Any, cursor: Any, *, restarted: bool = False) -> None:
        return None

    def average_gradients(self, models: list[nn.Module]) -> None:
        return None

    def commit(self, step: int) -> bool:
        return True

    def next_step(self, step: int, cursor: DataCursor) -> None:
        return None

    def close(self) -> None:
        return None


def replica_groups(options: Any, settings: Any, topology: Any, print_fn: Callable[[str], None],
                   strategy: Any, precision: str = "32") -> ReplicaQuorum | NoReplicaGroups:
    """This rank's replica axis: torchft's quorum when launched fault tolerant, else none.

    The script's layout is one group's (``--nproc-per-node`` ranks); the groups replicate
    it, averaging gradients every step, or, with ``semi_sync`` (LocalSGD, DiLoCo), meeting
    only at its outer syncs (:class:`~paratrain.fault_tolerance.rounds.OuterRounds`).
    """
    resolved = resolve(options, settings.replica_group, settings.lighthouse)
    if resolved is None:
        return NoReplicaGroups()
    # The quorum (torchft, DTensor) is imported only by a job launched fault tolerant:
    # importing it costs every other process half a second of start-up.
    from paratrain.fault_tolerance.quorum import ReplicaQuorum
    from paratrain.fault_tolerance.rounds import OuterRounds

    if precision == "16-mixed":
        # Each group's loss scaler picks its own scale: an average of gradients scaled
        # differently would be wrong, and the scales are not agreed across groups.
        raise ValueError("fault tolerance with precision='16-mixed' is not supported (each "
                         "replica group scales its loss on its own); use 'bf16-mixed' or '32'")
    ft, group = resolved
    mode = getattr(strategy, "semi_sync", None)
    if mode is None:
        return ReplicaQuorum(ft, group, rank=topology.rank, world_size=topology.world_size,
                             device=topology.device, print_fn=print_fn)
    name = type(mode).__name__
    if getattr(mode, "comm_dtype", None) == "int8":
        raise ValueError(f"{name}(comm_dtype='int8') gathers every group's bytes, which "
                         "torchft's quorum cannot; use comm_dtype='bf16' or None under "
                         "--fault-tolerant")
    if getattr(mode, "overlap", False):
        raise ValueError(f"{name}(overlap=True) keeps a sync in flight over the next step, "
                         "across which a quorum can change; use overlap=False under "
                         "--fault-tolerant")
    rounds = OuterRounds(ft, group, rank=topology.rank, world_size=topology.world_size,
                         device=topology.device, print_fn=print_fn)
    strategy.replicate_through(rounds)
    return rounds
