"""Which ``torch.distributed.pipelining`` schedule drives a pipeline, and where its stages live.

``Pipeline(schedule=...)`` names one of :data:`~paratrain.parallel.options.SCHEDULES`:

* ``gpipe``: all forwards, then all backwards (one stage per rank);
* ``1f1b``: one forward, one backward in the steady state (one stage per rank; the
  default; with fewer micro-batches than ranks it runs as GPipe, which computes the same);
* ``interleaved_1f1b``: ``stages_per_rank`` (>= 2) smaller stages per rank, looped: rank
  ``r`` of ``p`` runs stages ``r, r + p, ...``;
* ``interleaved_zero_bubble``: the same placement; each backward is split into the part
  for the stage's input (``I``, on the critical path) and the part for its weights
  (``W``), which fills the bubble (ZB1P, arXiv 2401.10241);
* ``zbv``: two stages per rank in a V: rank ``r`` runs stages ``r`` and ``2p - 1 - r``, so
  rank 0 holds the first and the last stage (ZB-V, same paper, section 6);
* ``dualpipev``: the same V, with a forward and a backward of two micro-batches overlapped
  (DeepSeek's DualPipe, one copy of the weights).

All of them compute the same gradients; they differ in how long ranks idle (see
:mod:`.bubble`) and in how many activations stay alive. Their constraints are torch's:
:func:`microbatch_refusal` names them in one line.
"""

from __future__ import annotations

from paratrain.parallel.options import MULTI_STAGE_SCHEDULES

SCHEDULE_CLASSES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "interleaved_zero_bubble": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""Schedule name -> the ``torch.distributed.pipelining`` class that runs it."""

V_SHAPED = tuple(name for name, kind in MULTI_STAGE_SCHEDULES.items() if kind == "v")
"""Schedules with two stages per rank placed in a V."""

SPLIT_BACKWARD = ("interleaved_zero_bubble", "zbv", "dualpipev")
"""Schedules that split a backward into the input's part and the weights' part (torch
runs them on modules that are not compiled only)."""


def stage_indices(schedule: str, rank: int, num_ranks: int, per_rank: int) -> list[int]:
    """The stages rank ``rank`` runs, in the order torch's schedule expects them."""
    if schedule in V_SHAPED:
        return [rank, 2 * num_ranks - 1 - rank]
    return [rank + k * num_ranks for k in range(per_rank)]


def stage_rank(schedule: str, stage: int, num_ranks: int) -> int:
    """The pipeline rank that runs ``stage``."""
    if schedule in V_SHAPED:
        return stage if stage < num_ranks else 2 * num_ranks - 1 - stage
    return stage % num_ranks


def microbatch_refusal(schedule: str, microbatches: int, num_ranks: int) -> str | None:
    """Why ``schedule`` cannot run ``microbatches`` micro-batches over ``num_ranks`` ranks
    (torch's constraints, as a clause), or None when it can."""
    m, p = microbatches, num_ranks
    if MULTI_STAGE_SCHEDULES.get(schedule) == "looped":
        rounds = max(1, m // p)  # torch runs the micro-batches in rounds of m // rounds
        if m % rounds:
            return (f"'{schedule}' runs micro-batches in rounds of equal size, "
                    f"{m} does not divide into {rounds} rounds over {p} ranks")
    if schedule == "dualpipev" and m < 2 * p:
        return f"'dualpipev' needs at least 2 x pp = {2 * p} micro-batches, got {m}"
    return None


def check_microbatches(schedule: str, microbatches: int, num_ranks: int) -> None:
    """One-line ValueError where the requested micro-batches cannot run."""
    why = microbatch_refusal(schedule, microbatches, num_ranks)
    if why is not None:
        raise ValueError(f"pipeline microbatches={microbatches} cannot run: {why}; "
                         "choose another number of microbatches or another schedule")

