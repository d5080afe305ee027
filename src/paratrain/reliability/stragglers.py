"""Naming the slow rank of a data-parallel job (the straggler), cheaply.

**The trap.** Every rank waits for the slowest one inside the step's collectives (DDP
all-reduces the gradients inside backward, FSDP reduce-scatters them there), so every
rank's wall time per step is the same: it says the job is slow, and names nobody.

**The method.** Each rank times what it does *before* it can be made to wait:

* *compute*: its training forwards, which under DDP run before the step's first
  collective (``time.perf_counter``; on a GPU CUDA events, read only at a check);
* *data*: the time blocked in the training loader's ``next``;
* *step*: the whole optimizer step, from one after-step hook to the next.

What is left, ``step - compute - data``, is backward, the optimizer and the waits
inside collectives: the *largest* on the fast ranks. Every ``check_every`` steps the
ranks all-gather their three means (over the health monitor's small gloo group). A
part is slow on a rank at ``margin`` times the median of the *other* ranks (with two
ranks: the other's) when it also exceeds it by ``min_share`` of the step, so noise in
a tiny data wait accuses nobody. A check accuses at most one rank, the one whose slow
part costs the most time; the same rank accused ``patience`` checks in a row is named
in one line on rank 0 (rank, host, its times against the medians, which part is slow),
once per episode, and in the metrics log, the trackers, ``run.epoch_stats`` and the bar.

**Limits.** FSDP all-gathers the parameters inside forward, so there the fast ranks'
forwards wait for the slow one too: a compute straggler is spread over every rank and
only data stragglers are named. A DDP model with buffers broadcasts them from rank 0 at
the start of forward, so rank 0's late data shows in the others' forwards (accusing the
worst rank keeps the data straggler named from three ranks on). The user's loop outside
forward and the loader is not timed. It runs where every rank takes every step over the
same model (not pipeline stages or parameter servers), and only observes: the losses
are bitwise those of a run without it.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from paratrain.fieldtypes import from_fields

__all__ = ["Accusation", "StragglerDetector", "Stragglers", "describe", "judge"]

PARTS = ("compute", "data")
_TINY_S = 1e-6  # a median below a microsecond is read as one (no division by zero)


@dataclass(frozen=True, kw_only=True)
class Stragglers:
    """``Run(stragglers=...)``: how often the ranks compare their times, when one is named."""

    check_every: int = 50
    """Optimizer steps between checks (one all-gather of three floats)."""
    margin: float = 1.2
    """A part (compute or data) is slow at this many times the other ranks' median."""
    patience: int = 3
    """Checks in a row the same rank must be the slow one before it is named."""
    min_share: float = 0.05
    """A slow part must also exceed the median by this share of the step."""

    def __post_init__(self) -> None:
        for name in ("check_every", "patience"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"stragglers.{name} must be an integer >= 1, got {value!r}")
        for name, ok, text in (("margin", lambda v: 1 < v < math.inf, "> 1 (e.g. 1.2)"),
                               ("min_share", lambda v: 0 <= v < 1, "in [0, 1) (e.g. 0.05)")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                raise ValueError(f"stragglers.{name} must be a number {text}, got {value!r}")

    @classmethod
    def parse(cls, value: Any) -> Stragglers | None:
        """True: the defaults; False or None: off; a dict of the fields or a Stragglers."""
        if value is True:
            return cls()
        if value is None or value is False:
            return None
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"stragglers must be True, False, None or a dict such as "
                             f"{{'check_every': 50, 'margin': 1.2}}, got {value!r}")
        return from_fields(cls, value, name="stragglers")


def median_of_others(values: Sequence[float], rank: int) -> float:
    """The median of ``values`` without ``rank``'s (with two ranks: the other's)."""
    others = [v for r, v in enumerate(values) if r != rank]
    return statistics.median(others) if others else 0.0


@dataclass(frozen=True)
class Accusation:
    """The slow rank of one check: which part is slow, and its time over the median."""

    rank: int
    part: str
    ratio: float


def judge(rows: Sequence[Sequence[float]], *, margin: float,
          min_share: float) -> tuple[Accusation | None, float]:
    """The slowest rank of one check (None when none is slow) and the check's ratio.

    ``rows[r]`` is rank r's ``(compute, data, step)`` in mean seconds per step. A part is
    slow when it exceeds the median of the other ranks' by ``margin`` times and by
    ``min_share`` of the median step; of those, the one that costs the most seconds is
    accused. The ratio is the accused part's over its median, else the largest compute
    ratio (a number that drifts up before anyone is accused).
    """
    floor = min_share * statistics.median(row[2] for row in rows)
    accused, worst, top = None, 0.0, 0.0
    for rank, row in enumerate(rows):
        for index, part in enumerate(PARTS):
            median = median_of_others([r[index] for r in rows], rank)
            ratio = row[index] / max(median, _TINY_S)
            if part == "compute":
                top = max(top, ratio)
            excess = row[index] - median
            if ratio > margin and excess > floor and excess > worst:
                accused, worst = Accusation(rank, part, ratio), excess
    return accused, accused.ratio if accused is not None else top


def describe(accused: Accusation, rows: Sequence[Sequence[float]], *, host: str,
             checks: int, every: int) -> str:
    """The one line that names a straggler, its times against the other ranks' medians."""
    rank = accused.rank
    rests = [s - c - d for c, d, s in rows]

    def versus(values: Sequence[float]) -> str:
        return f"{1e3 * values[rank]:.1f} vs {1e3 * median_of_others(values, rank):.1f} ms"

    return (f"paratrain: rank {rank} (host {host}) is a straggler, slow in {accused.part} "
            f"({accused.ratio:.2f}x the other ranks' median) for {checks} checks of {every} "
            f"steps: per step, compute {versus([r[0] for r in rows])}, data "
            f"{versus([r[1] for r in rows])}, backward/optimizer/waiting in collectives "
            f"{versus(rests)}; step {1e3 * rows[rank][2]:.1f} ms")


class ForwardClock:
    """Seconds of training forward since the last read: ``perf_counter`` on the CPU, CUDA
    events on a GPU (recorded each forward, read only by :meth:`read`)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds = 0.0
        self._pairs: list[tuple[Any, Any]] = []  # (start, end) events since the last read
        self._free: list[Any] = []

    def _event(self) -> Any:
        event = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        event.record()  # on the current stream, after the work queued so far
        return event

    def start(self) -> Any:
        return self._event() if self.cuda else time.perf_counter()

    def stop(self, started: Any) -> None:
        if self.cuda:
            self._pairs.append((started, self._event()))
        else:
            self.seconds += time.perf_counter() - started

    def read(self, *, discard: bool = False) -> float:
        """The seconds since the last read, then zero (a GPU waits for the last forward)."""
        total, self.seconds = self.seconds, 0.0
        if self._pairs and not discard:
            self._pairs[-1][1].synchronize()
            total += sum(s.elapsed_time(e) for s, e in self._pairs) / 1e3
        for pair in self._pairs:
            self._free.extend(pair)
        self._pairs.clear()
        return total


class StragglerDetector:
    """One rank's timings, the checks and their outcome (off when ``options`` is None).

    ``gather(tensor)``: rows by rank (a small all-gather); ``print_fn`` prints on rank 0;
    ``log(row, step=)`` feeds the metrics log and the trackers."""

    def __init__(self, options: Stragglers | None, *, gather: Callable[[torch.Tensor], Any],
                 host: Callable[[int], str], device: torch.device,
                 print_fn: Callable[[str], None], log: Callable[..., None]) -> None:
        self.options = options
        self.gather, self.host, self.print_fn, self.log = gather, host, print_fn, log
        self.clock = ForwardClock(device)
        self.reports: list[str] = []
        """The lines that named a straggler (every rank keeps them; rank 0 prints them)."""
        self.checks = 0
        self.current: Accusation | None = None
        """The named straggler while it stays slow, else None."""
        self._calls, self._steps = 0, 0
        self._data_s = self._step_s = 0.0
        self._last: float | None = None
        self._suspect, self._streak = None, 0  # the rank accused at the last checks
        self._epoch_rank: int | None = None  # named in this epoch
        self._epoch_ratio: float | None = None  # the largest check ratio of this epoch

    @classmethod
    def for_run(cls, options: Stragglers | None, *, health: Any, lockstep: bool,
                **kwargs: Any) -> StragglerDetector:
        """Active with ``options`` where every rank of a multi-rank job takes every step."""
        active = options is not None and lockstep and health.group is not None
        return cls(options if active else None, gather=health.gather, host=health.host,
                   **kwargs)

    def watch(self, model: nn.Module) -> None:
        """Time ``model``'s training forwards, as the loop calls them (outermost)."""
        if self.options is None:
            return
        inner, clock = model.forward, self.clock

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not (model.training and torch.is_grad_enabled()):
                return inner(*args, **kwargs)
            started = clock.start()
            try:
                return inner(*args, **kwargs)
            finally:
                clock.stop(started)

        model.forward = forward  # type: ignore[method-assign]

    def after_step(self, global_step: int, data_s: float) -> None:
        """Count a step (``data_s``: its loader wait); every ``check_every`` steps, check."""
        if self.options is None:
            return
        now = time.perf_counter()
        self._calls += 1
        if self._last is None:  # the first step warms up, and its start is unknown
            self._last = now
            self.clock.read(discard=True)
            return
        self._steps += 1
        self._data_s += data_s
        self._step_s += now - self._last
        self._last = now
        if self._calls % self.options.check_every == 0:
            self._check(global_step)

    def _check(self, global_step: int) -> None:
        options, steps = self.options, self._steps
        mine = torch.tensor([self.clock.read(), self._data_s, self._step_s],
                            dtype=torch.float64) / steps
        self._steps, self._data_s, self._step_s = 0, 0.0, 0.0
        rows = self.gather(mine).tolist()
        self.checks += 1
        accused, ratio = judge(rows, margin=options.margin, min_share=options.min_share)
        if accused is not None and accused.rank == self._suspect:
            self._streak += 1
        else:
            self._suspect = None if accused is None else accused.rank
            self._streak = 0 if accused is None else 1
        self.current = accused if self._streak >= options.patience else None
        if self._streak == options.patience:  # once per episode
            line = describe(accused, rows, host=self.host(accused.rank),
                            checks=self._streak, every=options.check_every)
            self.reports.append(line)
            self.print_fn(line)
        if self.current is not None:
            self._epoch_rank = self.current.rank
        self._epoch_ratio = ratio if self._epoch_ratio is None else max(self._epoch_ratio, ratio)
        self.log({"straggler": None if self.current is None else self.current.rank,
                  "straggler_ratio": ratio}, step=global_step)
        # The wait for the slowest rank in this gather is no rank's step time.
        self._last = time.perf_counter()

    def take_epoch(self) -> dict[str, Any]:
        """``straggler`` (the rank named in the epoch, or None) and ``straggler_ratio`` (the
        largest check ratio); nothing where the detector is off."""
        if self.options is None:
            return {}
        stats = {"straggler": self._epoch_rank, "straggler_ratio": self._epoch_ratio}
        self._epoch_rank = None if self.current is None else self.current.rank
        self._epoch_ratio = None
        return stats

    def bar_rates(self, rates: Callable[[float], dict[str, Any]]) -> Callable[[float], dict]:
        """``rates`` with ``straggler`` added while one is named (the progress bar)."""
        if self.options is None:
            return rates

        def with_straggler(samples_per_s: float) -> dict[str, Any]:
            named = self.current
            extra = {} if named is None else {"straggler": f"{named.rank} ({named.part})"}
            return {**rates(samples_per_s), **extra}

        return with_straggler
