"""Fault-tolerant training without a restart: replica groups, a torchft quorum, healing.

See :mod:`paratrain.fault_tolerance.options` for what a job is told and how the timeouts
nest, :mod:`~paratrain.fault_tolerance.quorum` for the step,
:mod:`~paratrain.fault_tolerance.rounds` for LocalSGD/DiLoCo across groups (they meet
at outer syncs only), and :mod:`~paratrain.fault_tolerance.heal` for what a healing peer
receives.
"""

from paratrain.fault_tolerance.options import FaultTolerance, ReplicaGroup, resolve
from paratrain.fault_tolerance.quorum import LighthouseUnreachable, ReplicaQuorum

__all__ = ["FaultTolerance", "LighthouseUnreachable", "ReplicaGroup", "ReplicaQuorum", "resolve"]
