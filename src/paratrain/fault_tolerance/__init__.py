"""Fault-tolerant training without a restart: replica groups, a torchft quorum, healing.

See :mod:`paratrain.fault_tolerance.options` for what a job is told and how the timeouts
nest, :mod:`~paratrain.fault_tolerance.quorum` for the step,
:mod:`~paratrain.fault_tolerance.rounds` for LocalSGD/DiLoCo across groups (they meet
at outer syncs only), and :mod:`~paratrain.fault_tolerance.heal` for what a healing peer
receives.
"""

from typing import TYPE_CHECKING, Any

from paratrain.fault_tolerance.options import FaultTolerance, ReplicaGroup, resolve

if TYPE_CHECKING:
    from paratrain.fault_tolerance.quorum import LighthouseUnreachable, ReplicaQuorum


def __getattr__(name: str) -> Any:
    # The quorum (DTensor, torchft) is imported on first use: the launcher reads only
    # the options, and importing DTensor costs every launch half a second.
    if name in ("LighthouseUnreachable", "ReplicaQuorum"):
        from paratrain.fault_tolerance import quorum

        return getattr(quorum, name)
    raise AttributeError(f"module 'paratrain.fault_tolerance' has no attribute {name!r}")

__all__ = ["FaultTolerance", "LighthouseUnreachable", "ReplicaGroup", "ReplicaQuorum", "resolve"]
