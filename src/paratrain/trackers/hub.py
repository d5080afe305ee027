"""Rank 0's experiment trackers, fed from the training loop without slowing it or stopping it.

Each tracker gets a thread and a queue of its own: the loop only puts a row on the
queues (microseconds), while a tracker's client may take a server round trip per call,
retry for minutes when the server is gone, or raise. A tracker that fails prints one
warning line and is switched off; training and the other trackers go on.

Resume: a checkpoint holds each tracker's run id (``state_dict``, written after the
queues are flushed, so every step up to the checkpoint is in the tracker). Resuming
re-opens that run, and steps the tracker already holds (logged after the checkpoint,
before the interruption, and now computed again) are not logged twice.
"""

from __future__ import annotations

import dataclasses
import numbers
import queue
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from paratrain.trackers.base import NAMES, Tracker, check_available

__all__ = ["TrackerHub", "run_params", "tracker_for"]

_BACKLOG = 100_000  # queued calls before a tracker that cannot keep up is switched off


def tracker_for(spec: Any, *, tensorboard_dir: str | None = None) -> Tracker:
    """The :class:`Tracker` for one entry of ``Run(loggers=...)``: an instance or a name."""
    if isinstance(spec, Tracker):
        tracker = spec
    elif spec == "mlflow":
        from paratrain.trackers.mlflow import MLflowTracker

        tracker = MLflowTracker()
    elif spec == "wandb":
        from paratrain.trackers.wandb import WandbTracker

        tracker = WandbTracker()
    elif spec == "tensorboard":
        from paratrain.trackers.tensorboard import TensorBoardTracker

        tracker = TensorBoardTracker(log_dir=tensorboard_dir)
    else:
        raise ValueError(f"loggers entries must be one of {', '.join(map(repr, NAMES))} or a "
                         f"paratrain.trackers.Tracker, got {spec!r}")
    check_available(tracker)
    return tracker


def run_params(config: Any, **layout: Any) -> dict[str, Any]:
    """The run's configuration (a dataclass) and ``layout`` as flat tracker parameters."""
    params: dict[str, Any] = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if f.name != "loggers":
            params[f.name] = value if isinstance(value, (bool, int, float, str)) or value is None \
                else repr(value)
    return {**params, **layout}


class TrackerHub:
    """Fans rows out to trackers (rank 0; an empty hub elsewhere), each on its own thread.

    ``memory()`` gives the process's peak memory in bytes, added to every row.
    """

    def __init__(self, trackers: list[Tracker], *, directory: Path, params: dict[str, Any],
                 memory: Callable[[], int] | None = None, timeout_s: float = 30.0) -> None:
        self._workers = [_Worker(t, directory, params) for t in trackers]
        self._memory = memory
        self.timeout_s = timeout_s
        """How long a checkpoint or ``close`` waits for a tracker to catch up."""
        self.current_step: Callable[[], int] | None = None
        """The run's global step, read at a checkpoint (``Run`` sets it)."""

    def __bool__(self) -> bool:
        return bool(self._workers)

    def log(self, row: dict[str, Any], *, step: int) -> None:
        """Queue ``row`` at ``step`` for every tracker (tensors are read in the threads)."""
        if not self._workers:
            return
        row = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in row.items()}
        if self._memory is not None:
            row["memory/peak_mb"] = self._memory() / 2**20
        for worker in self._workers:
            worker.put(("log", (row, step)))

    def state_dict(self) -> dict[str, Any] | None:
        """Each tracker's run id, once everything logged so far is in the tracker."""
        if not self._workers:
            return None
        step = self.current_step() if self.current_step is not None else None
        events = [worker.put(("flush", (threading.Event(), step))) for worker in self._workers]
        for worker, event in zip(self._workers, events):
            deadline = time.monotonic() + self.timeout_s
            # In slices: a tracker that fails meanwhile never sets its event.
            while event is not None and not event.wait(0.05) and not worker.failed:
                if time.monotonic() > deadline:
                    worker.fail(f"did not catch up within {self.timeout_s:g} s before a "
                                "checkpoint")
        return {w.tracker.name: w.state for w in self._workers if w.state is not None}

    def load_state_dict(self, saved: dict[str, Any] | None, *, step: int) -> None:
        """Re-open the tracker runs a checkpoint at ``step`` names (before any new step)."""
        for worker in self._workers:
            previous = (saved or {}).get(worker.tracker.name)
            if previous is not None:
                worker.put(("resume", {**previous, "step": step}))

    def close(self) -> None:
        """Finish every tracker run (as failed while an exception ends the run)."""
        failed = sys.exc_info()[1] is not None
        for worker in self._workers:
            worker.put(("close", failed))
        for worker in self._workers:
            worker.join(self.timeout_s)
        self._workers = []


class _Worker:
    """One tracker's queue and thread; started at the first call."""

    def __init__(self, tracker: Tracker, directory: Path, params: dict[str, Any]) -> None:
        self.tracker = tracker
        self.directory = directory
        self.params = params
        self.state: dict[str, Any] | None = None
        self.failed = False
        self._queue: queue.Queue = queue.Queue(maxsize=_BACKLOG)
        self._thread: threading.Thread | None = None
        self._started = False
        self._marks: dict[str, int] = {}  # last step the tracker held at a resume, per key
        self._mark_max = -1

    def put(self, item: tuple) -> threading.Event | None:
        """Queue ``item``; returns a flush's event, or None when there is nothing to wait for."""
        if self.failed:
            return None
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, daemon=True,
                                            name=f"paratrain-{self.tracker.name}")
            self._thread.start()
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.fail(f"is {_BACKLOG} calls behind (a slow or unreachable server?)")
            return None
        return item[1][0] if item[0] == "flush" else None

    def join(self, timeout_s: float) -> None:
        if self._thread is not None and not self.failed:  # a failed one is not waited for
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                self.fail(f"did not finish within {timeout_s:g} s; its last metrics may be "
                          "missing")

    def fail(self, reason: str) -> None:
        """Warn once, in one line, and switch this tracker off."""
        if self.failed:
            return
        self.failed = True
        print(f"paratrain: warning: tracker {self.tracker.name} {reason}; it is off for the rest "
              "of this run, training goes on", file=sys.stderr, flush=True)

    def _loop(self) -> None:
        while not self.failed:
            op, arg = self._queue.get()
            try:
                self._handle(op, arg)
            except Exception as exc:  # the client's failure must never reach training
                message = " ".join(str(exc).split())[:300]
                self.fail(f"failed ({type(exc).__name__}: {message})" if message
                          else f"failed ({type(exc).__name__})")
            finally:
                if op == "flush":
                    arg[0].set()
            if op == "close":
                return

    def _handle(self, op: str, arg: Any) -> None:
        if op == "resume":
            if self._started:  # a row was logged before the resume: a fresh run is open
                self.tracker.finish(failed=False)
            self._start(arg)
        elif op == "close":
            if self._started:
                self.tracker.finish(failed=arg)
        else:
            if not self._started:
                self._start(None)
            if op == "log":
                self._log(*arg)
            else:  # flush, before a checkpoint at step arg[1]
                self.tracker.checkpoint(arg[1])
                self.state = self.tracker.state()

    def _start(self, resume: dict[str, Any] | None) -> None:
        marks = self.tracker.start(params=self.params, directory=self.directory, resume=resume)
        self._started = True
        self._marks = dict(marks or {})
        self._mark_max = max(self._marks.values(), default=-1)
        self.state = self.tracker.state()

    def _log(self, row: dict[str, Any], step: int) -> None:
        values = {k: v for k, v in ((k, _number(v)) for k, v in row.items()) if v is not None}
        if step <= self._mark_max:
            # Already in the tracker from before the interruption: not logged twice.
            everything = self._marks.get("*", -1)
            values = {k: v for k, v in values.items()
                      if step > max(everything, self._marks.get(k, -1))}
        if values:
            self.tracker.log(values, step)


def _number(value: Any) -> float | None:
    """A float for a number or one-element tensor; None for what trackers cannot plot."""
    if isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 else None
    if isinstance(value, numbers.Real):
        return float(value)
    return None
