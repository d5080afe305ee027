"""What fault-tolerant training is told: the replica group, the lighthouse, the timeouts.

A fault-tolerant job is several *replica groups*, each its own ``torch.distributed`` world
(its own ``torchrun``, restarted on its own), that average gradients through torchft: a
lighthouse forms a quorum of the live groups before every step, and a group that died and
came back heals from a live peer instead of a checkpoint. ``paratrain launch
--fault-tolerant`` starts the lighthouse and the groups and tells each worker its group in
``PARATRAIN_REPLICA_GROUP`` (``G/R``) and the lighthouse in ``PARATRAIN_LIGHTHOUSE``.

The timeouts nest, and :meth:`FaultTolerance.__post_init__` refuses an order that cannot
work, in one line: a collective across groups gives up (``collective_timeout_s``) before
the step that waits on it does (``step_timeout_s``: the commit vote, the transfer of a
healing peer's state), and a step gives up before a quorum does (``quorum_timeout_s``: how
long a group waits for the others to join), which must outlast the lighthouse's heartbeat
timeout (``LIGHTHOUSE_HEARTBEAT_S``: how long a silent group stays a member, so how long the
survivors of a crash wait before the quorum drops it). Inside a group,
``Run(timeout_s=...)`` bounds the group's own collectives, as without fault tolerance.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

from paratrain.fieldtypes import from_fields

__all__ = ["LIGHTHOUSE_HEARTBEAT_S", "LIGHTHOUSE_JOIN_S", "FaultTolerance", "ReplicaGroup",
           "group_checkpoint_dir", "parse_replica_group", "resolve"]

LIGHTHOUSE_HEARTBEAT_S = 2.0
"""A group silent this long leaves the quorum (the lighthouse ``paratrain launch`` starts)."""
LIGHTHOUSE_JOIN_S = 1.0
"""How long a quorum waits for live groups that have not asked to join yet."""


@dataclass(frozen=True)
class FaultTolerance:
    """Options of fault-tolerant training (``Run(fault_tolerance=...)``; defaults apply when
    the job is launched with ``paratrain launch --fault-tolerant`` and this is left out).

    ``min_groups``: the fewest replica groups a step may commit with (below it, the step's
    update is held until enough groups are back). ``collective_timeout_s`` <
    ``step_timeout_s`` < ``quorum_timeout_s``, and the lighthouse's heartbeat timeout <
    ``quorum_timeout_s``: see the module's docstring.
    """

    min_groups: int = 1
    collective_timeout_s: float = 20.0
    step_timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if isinstance(self.min_groups, bool) or not isinstance(self.min_groups, int) \
                or self.min_groups < 1:
            raise ValueError(f"FaultTolerance.min_groups must be an integer >= 1, got "
                             f"{self.min_groups!r}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name.endswith("_s") and (isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not math.isfinite(value) or value <= 0):
                raise ValueError(f"FaultTolerance.{field.name} must be a number of seconds > 0, "
                                 f"got {value!r}")
        if self.quorum_timeout_s <= LIGHTHOUSE_HEARTBEAT_S + LIGHTHOUSE_JOIN_S:
            raise ValueError(f"FaultTolerance.quorum_timeout_s ({self.quorum_timeout_s:g} s) must "
                             f"outlast the lighthouse's heartbeat and join timeouts "
                             f"({LIGHTHOUSE_HEARTBEAT_S + LIGHTHOUSE_JOIN_S:g} s), or a crash "
                             "ends the survivors' quorum before it drops the dead group")
        for low, high in [("collective_timeout_s", "step_timeout_s"),
                          ("step_timeout_s", "quorum_timeout_s")]:
            if getattr(self, low) >= getattr(self, high):
                raise ValueError(
                    f"FaultTolerance.{low} ({getattr(self, low):g} s) must be shorter than "
                    f"{high} ({getattr(self, high):g} s): the timeouts nest as collective < "
                    "step < quorum (docs/reliability.md)")

    @classmethod
    def coerce(cls, value: Any) -> FaultTolerance | None:
        """``None``, a :class:`FaultTolerance` or a dict of its fields (``Run(...)``)."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, dict):
            return from_fields(cls, value, name="fault_tolerance")
        raise ValueError(f"fault_tolerance must be a FaultTolerance or a dict of its fields, got "
                         f"{value!r}")


@dataclass(frozen=True)
class ReplicaGroup:
    """Which replica group this process belongs to, of how many, and the lighthouse."""

    index: int
    count: int
    lighthouse: str


def parse_replica_group(text: str) -> tuple[int, int]:
    """``"1/3"`` -> ``(1, 3)``; ValueError naming ``PARATRAIN_REPLICA_GROUP`` otherwise."""
    index, sep, count = text.partition("/")
    try:
        group, groups = int(index), int(count)
    except ValueError:
        group = groups = -1
    if not sep or groups < 1 or not 0 <= group < groups:
        raise ValueError(f"PARATRAIN_REPLICA_GROUP must be GROUP/GROUPS with 0 <= GROUP < GROUPS "
                         f"(e.g. 0/2), got {text!r}")
    return group, groups


def resolve(options: Any, replica_group: str | None,
            lighthouse: str | None) -> tuple[FaultTolerance, ReplicaGroup] | None:
    """The options and this process's group when the job is fault tolerant, else None.

    Fault tolerance needs the launcher's two variables; ``Run(fault_tolerance=...)``
    without them is refused in one line saying how to launch.
    """
    ft = FaultTolerance.coerce(options)
    if replica_group is None and lighthouse is None:
        if ft is not None:
            raise ValueError("Run(fault_tolerance=...) needs its replica groups and a lighthouse: "
                             "start the job with `paratrain launch --fault-tolerant "
                             "--replica-groups R ...`")
        return None
    if replica_group is None or lighthouse is None:
        missing = "PARATRAIN_REPLICA_GROUP" if replica_group is None else "PARATRAIN_LIGHTHOUSE"
        raise ValueError(f"{missing} is not set but its partner is; start the job with "
                         "`paratrain launch --fault-tolerant`, which sets both")
    group, groups = parse_replica_group(replica_group)
    return ft or FaultTolerance(), ReplicaGroup(group, groups, lighthouse)


def group_checkpoint_dir(config: Any, replica_group: str | None) -> Any:
    """``config`` with its ``checkpoint_dir`` made this replica group's own subfolder
    (``replica-group-G``): each group is its own job with its own rank 0, which locks and
    writes its checkpoints (for a whole-job restart, ``--max-restarts``)."""
    if replica_group is None or config.checkpoint_dir is None:
        return config
    group, _ = parse_replica_group(replica_group)
    directory = os.path.join(os.fspath(config.checkpoint_dir), f"replica-group-{group}")
    return dataclasses.replace(config, checkpoint_dir=directory)
