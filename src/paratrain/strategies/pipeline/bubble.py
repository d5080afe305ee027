"""The pipeline bubble of a schedule, computed from torch's own action lists.

Each torch schedule plans, per rank, an ordered list of compute actions: ``F`` (a
stage's forward of one micro-batch), ``B`` (its whole backward), or the backward split
into ``I`` (the gradient for the stage's input, which the previous stage waits for) and
``W`` (the gradient for its weights, which nothing waits for). :func:`timeline` runs
those lists as soon as the dependencies allow, with the costs of :data:`COSTS`:

* ``F(s, i)`` after ``F(s - 1, i)``;
* ``I(s, i)`` / ``B(s, i)`` after ``F(s, i)`` and after ``I`` or ``B`` of ``(s + 1, i)``;
* ``W(s, i)`` after ``I(s, i)``;
* each rank runs its own list in order, one action at a time; sends and receives are
  free.

The bubble is the idle share of ``ranks x makespan``. With ``F = I = W = 1`` (so a
whole backward ``B = I + W = 2``, the usual 1:2 forward to backward) 1F1B and GPipe give
the textbook ``(p - 1) / (m + p - 1)``; interleaving ``v`` stages per rank divides the
ramp by ``v``; the zero-bubble schedules fill it with ``W``.

    >>> round(bubble_fraction("1f1b", 4, 8), 4)  # (4 - 1) / (8 + 4 - 1)
    0.2727
"""

from __future__ import annotations

from paratrain.distributed._compat import schedule_actions
from paratrain.parallel.options import Pipeline
from paratrain.strategies.pipeline.schedules import (
    SCHEDULE_CLASSES,
    check_microbatches,
    stage_indices,
)

Action = tuple[str, int, int]
"""``(kind, stage, micro-batch)``: kind ``F``, ``B``, ``I`` or ``W``."""

COSTS = {"F": 1.0, "I": 1.0, "W": 1.0, "B": 2.0}
"""Equal costs: forward = backward for the input = backward for the weights; a whole
backward is both."""


def actions(schedule: str, num_ranks: int, microbatches: int,
            per_rank: int | None = None) -> dict[int, list[Action]]:
    """Each rank's compute actions under ``schedule``, as torch plans them."""
    options = Pipeline(schedule=schedule, microbatches=microbatches, stages_per_rank=per_rank)
    schedule = options.schedule
    if num_ranks < 2:
        raise ValueError(f"a pipeline needs at least 2 ranks, got {num_ranks}")
    check_microbatches(schedule, microbatches, num_ranks)
    if schedule == "1f1b" and microbatches < num_ranks:
        schedule = "gpipe"  # what the pipeline runs then (torch's 1F1B refuses)
    local = stage_indices(schedule, 0, num_ranks, options.num_local_stages)
    return _numbered(schedule_actions(SCHEDULE_CLASSES[schedule], num_ranks, microbatches,
                                      local), microbatches)


def _numbered(order: dict[int, list[Action]], microbatches: int) -> dict[int, list[Action]]:
    # Every schedule runs a stage's forwards in micro-batch order, and numbers them so,
    # except in the plan torch's single-stage Schedule1F1B prints (not the loop it runs),
    # whose last rank counts its forwards 1..m: such a stage's forwards are renumbered.
    # ValueError unless every stage then runs each micro-batch's F, I and W once.
    expected = list(range(microbatches))
    numbered = {}
    for rank, rank_actions in order.items():
        forwards: dict[int, list[int]] = {}
        for kind, stage, index in rank_actions:
            if kind == "F":
                forwards.setdefault(stage, []).append(index)
        slipped = {stage for stage, indices in forwards.items() if sorted(indices) != expected}
        count = dict.fromkeys(slipped, 0)
        numbered[rank] = []
        for kind, stage, index in rank_actions:
            if kind == "F" and stage in slipped:
                index, count[stage] = count[stage], count[stage] + 1
            numbered[rank].append((kind, stage, index))
        for stage in forwards:
            for parts in (("F",), ("B", "I"), ("B", "W")):
                runs = sorted(i for k, s, i in numbered[rank] if s == stage and k in parts)
                if runs != expected:
                    raise ValueError(f"torch's plan does not run {'/'.join(parts)} of every "
                                     f"micro-batch once on stage {stage}")
    return numbered


def timeline(order: dict[int, list[Action]], num_stages: int,
             costs: dict[str, float] = COSTS) -> dict[Action, tuple[float, float]]:
    """``(start, end)`` of every action, each as early as its rank and dependencies allow.

    ValueError naming the stuck actions if the lists deadlock.
    """
    done: dict[tuple[str, int, int], float] = {}  # (F | I | W, stage, mb) -> end
    spans: dict[Action, tuple[float, float]] = {}
    free = {rank: 0.0 for rank in order}
    position = {rank: 0 for rank in order}

    def needs(kind: str, stage: int, index: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", stage - 1, index)] if stage > 0 else []
        if kind == "W":
            return [("I", stage, index)]
        after = [("I", stage + 1, index)] if stage < num_stages - 1 else []
        return [("F", stage, index), *after]

    remaining = sum(len(a) for a in order.values())
    while remaining:
        progressed = False
        for rank, rank_actions in order.items():
            while position[rank] < len(rank_actions):
                action = rank_actions[position[rank]]
                kind, stage, index = action
                deps = needs(kind, stage, index)
                if any(d not in done for d in deps):
                    break
                start = max([free[rank], *(done[d] for d in deps)])
                end = start + costs[kind]
                spans[action], free[rank] = (start, end), end
                for part in ("I", "W") if kind == "B" else (kind,):
                    done[(part, stage, index)] = end
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = [a[position[r]] for r, a in order.items() if position[r] < len(a)]
            raise ValueError(f"the schedule's actions deadlock at {stuck}")
    return spans


def bubble_fraction(schedule: str, num_ranks: int, microbatches: int,
                    stages_per_rank: int | None = None,
                    costs: dict[str, float] = COSTS) -> float:
    """The idle share of ``num_ranks`` ranks over one step of ``schedule``."""
    order = actions(schedule, num_ranks, microbatches, stages_per_rank)
    num_stages = len({stage for a in order.values() for _, stage, _ in a})
    spans = timeline(order, num_stages, costs)
    makespan = max(end for _, end in spans.values())
    busy = sum(end - start for start, end in spans.values())
    return 1.0 - busy / (num_ranks * makespan)
