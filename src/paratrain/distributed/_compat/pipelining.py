"""Private torch.distributed.pipelining internals: schedules' action lists (see the package's docstring)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from paratrain.distributed._compat.errors import missing as _missing


class _PlanningStage:
    """What a schedule's constructor reads of a ``PipelineStage``, without a process group
    (duck-typing the private ``_PipelineStageBase``): enough to build its action list."""

    submod = None

    def __init__(self, index: int, num_stages: int, num_ranks: int) -> None:
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = num_ranks, 0
        self.is_first, self.is_last = index == 0, index == num_stages - 1


def schedule_actions(class_name: str, num_ranks: int, microbatches: int,
                     rank0_stages: Sequence[int]) -> dict[int, list[tuple[str, int, int]]]:
    """Each rank's compute actions, in order, as torch's schedule ``class_name`` plans them.

    The schedule is built on stand-in stages of rank 0 (``rank0_stages``; every rank's
    plan is computed on every rank) and its ``pipeline_order`` (``_Action`` tuples,
    private) read: ``(kind, stage, micro-batch)`` with kind ``F`` (forward), ``B`` (full
    backward), ``I`` (backward for the input) or ``W`` (for the weights); an overlapped
    forward + backward becomes its two parts; idle slots and gradient reductions are
    dropped. ValueError (torch's message) where torch refuses the combination.
    """
    from torch.distributed import pipelining

    cls = getattr(pipelining, class_name, None)
    if cls is None:
        raise _missing(f"torch.distributed.pipelining.{class_name}")
    num_stages = num_ranks * len(rank0_stages)
    stages = [_PlanningStage(i, num_stages, num_ranks) for i in rank0_stages]
    single = issubclass(cls, pipelining.schedules.PipelineScheduleSingle)
    schedule = cls(stages[0] if single else stages, n_microbatches=microbatches)
    order = getattr(schedule, "pipeline_order", None)
    if not isinstance(order, dict):
        raise _missing(f"{class_name}.pipeline_order")

    def flat(action: Any) -> list[tuple[str, int, int]]:
        if action is None:
            return []
        if getattr(action, "sub_actions", None):
            return [a for sub in action.sub_actions for a in flat(sub)]
        kind = getattr(action.computation_type, "value", None)
        return ([(kind, action.stage_index, action.microbatch_index)]
                if kind in ("F", "B", "I", "W") else [])

    return {rank: [a for action in order[rank] for a in flat(action)]
            for rank in sorted(order)}


def keep_forwards_only(schedule: Any) -> Any:
    """``schedule`` (a multi-stage torch schedule, built) reduced to its forward actions.

    torch's runtime runs a V schedule's backward actions even without a loss (it hands
    the gradient between the two stages of one rank, which fails when there is none):
    evaluation keeps the forwards of the plan lowered to communication
    (``pipeline_order_with_comms``, private) with their sends and receives, in order.
    """
    order = getattr(schedule, "pipeline_order_with_comms", None)
    if not isinstance(order, dict):
        raise _missing(f"{type(schedule).__name__}.pipeline_order_with_comms")
    keep = ("F", "SEND_F", "RECV_F", "UNSHARD", "RESHARD")

    def forwards(action: Any) -> list[Any]:
        if getattr(action, "sub_actions", None):
            return [a for sub in action.sub_actions for a in forwards(sub)]
        return [action] if getattr(action.computation_type, "value", None) in keep else []

    schedule.pipeline_order_with_comms = {
        rank: [a for action in actions for a in forwards(action)]
        for rank, actions in order.items()}
    return schedule
