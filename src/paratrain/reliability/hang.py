"""Name the stuck collective: a watchdog per rank and a one-line-per-rank diagnosis.

Each rank runs a daemon thread that looks at its :class:`CollectiveRecorder`
every ``warn_after_s / 4`` seconds (at most 5 s). When this rank's blocking
collective (or its loop phase: DDP's gradient all-reduces run inside backward,
where Python cannot see them) has lasted longer than ``warn_after_s``, it raises an alarm in the
job's store; every rank's watchdog answers the alarm with a snapshot of where
it is, and rank 0 prints one line per rank that is elsewhere than the most
common place, for example::

    paratrain: rank 1 (host h1) is in all_reduce f32[431242] at train.py:88 (collective #7, \
waiting 61 s); ranks 0, 2, 3 are in all_gather f32[64] at train.py:95 (collective #7)

The exchange goes through the store (a TCP key-value server), not a process
group: the training group is the one that is blocked, and the health group is
used by the main thread (step checks, the SIGTERM agreement), so collectives on
it from a second thread could pair with the wrong ones.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

import torch.distributed as dist

from paratrain.reliability.collectives import CollectiveRecorder


def warn_after_s(timeout_s: float | None, configured_s: float) -> float:
    """Seconds a collective may wait before the diagnosis (``PARATRAIN_COLLECTIVE_WARN_S``,
    default 60 s, 0 disables the report and the recording), capped at half the collective
    timeout so that the diagnosis comes before the timeout ends the job."""
    if configured_s and timeout_s:
        return min(configured_s, timeout_s / 2)
    return configured_s


def default_store() -> Any:
    """The job's store (a private c10d accessor, guarded), or None where it is unavailable."""
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    if getter is None or not dist.is_initialized():
        return None
    try:
        return getter()
    except (RuntimeError, ValueError):
        return None


def _place(snap: Mapping[str, Any] | None) -> tuple[Any, ...]:
    """What two ranks must share to be at the same place."""
    if snap is None:
        return ("silent",)
    cur = snap.get("current")
    if cur is not None:
        return ("in", cur["op"], cur["what"], cur["group"], cur["site"], cur["seq"])
    phase = snap.get("phase")
    return ("out", phase[0] if phase else None, phase[1] if phase else None, snap.get("count"))


def _collective(entry: Mapping[str, Any]) -> str:
    """``all_reduce f32[8] on group [0, 2] at train.py:88``."""
    what = f" {entry['what']}" if entry["what"] else ""
    group = f" on {entry['group']}" if entry["group"] else ""
    return f"{entry['op']}{what}{group} at {entry['site']}"


def _where(snap: Mapping[str, Any] | None, *, waited: bool) -> str:
    if snap is None:
        return "did not answer (process gone, or stopped in native code)"
    cur = snap.get("current")
    if cur is not None:
        extra = f", waiting {cur['age']:g} s" if waited else ""
        return f"in {_collective(cur)} (collective #{cur['seq'] + 1}{extra})"
    phase, last = snap.get("phase"), snap.get("last")
    text = "not in a collective"
    if phase:
        text = f"in {phase[0]} at {phase[1]}, " + text
        if phase[0] == "backward":
            text += " (DDP's gradient all-reduces run inside backward, unrecorded)"
    if last:
        text += (f"; its last was {_collective(last)} "
                 f"(collective #{last['seq'] + 1}, {last['age']:g} s ago)")
    else:
        text += "; it has entered none yet"
    return text


def diagnose(snapshots: Sequence[Mapping[str, Any] | None], hosts: Sequence[str]) -> list[str]:
    """One line per rank away from the most common place (ties: the lowest rank's).

    ``snapshots[r]`` is rank r's :meth:`CollectiveRecorder.snapshot` (None: no answer).
    """
    places = [_place(s) for s in snapshots]
    counts = Counter(p for p in places if p != ("silent",))
    if not counts:
        return []
    best = max(counts.values())
    common = next(p for p in places if counts.get(p) == best)
    ref_ranks = [r for r, p in enumerate(places) if p == common]
    ref = snapshots[ref_ranks[0]]
    who = ("rank " if len(ref_ranks) == 1 else "ranks ") + ", ".join(map(str, ref_ranks))
    verb = "is" if len(ref_ranks) == 1 else "are"
    odd = [r for r, p in enumerate(places) if p != common]
    if not odd:
        if common[0] != "in":  # all in the same phase, no collective: slow, not stuck
            return []
        return [f"paratrain: all {len(places)} ranks are {_where(ref, waited=True)}; none is "
                "elsewhere: a slow or stuck link or device (or a peer outside this job)"]
    host = [h or "unknown host" for h in hosts] + ["unknown host"] * len(places)
    return [f"paratrain: rank {r} (host {host[r]}) {'' if snapshots[r] is None else 'is '}"
            f"{_where(snapshots[r], waited=True)}; {who} {verb} {_where(ref, waited=False)}"
            for r in odd]


class HangWatchdog:
    """A daemon thread per rank that reports a collective waiting past ``warn_after_s``.

    Args:
        recorder: this rank's record.
        rank, world_size: this process's place.
        hosts: every rank's host as known at start (this rank's is sent with its snapshot).
        store: the job's store (None: each rank prints only its own place).
        warn_after_s: the wait that triggers the report.
        out: where rank 0 prints (default stderr).
    """

    def __init__(self, *, recorder: CollectiveRecorder, rank: int, world_size: int,
                 hosts: Sequence[str], store: Any, warn_after_s: float,
                 out: TextIO | None = None) -> None:
        self.recorder, self.rank, self.world_size = recorder, rank, world_size
        self.hosts = list(hosts)
        self.host = self.hosts[rank] if rank < len(self.hosts) else "unknown host"
        self.store = dist.PrefixStore("paratrain/hang", store) if store is not None else None
        self.warn_after_s = warn_after_s
        self.poll_s = min(max(warn_after_s / 4, 0.05), 5.0)
        self.out = out
        self.reports: list[str] = []
        """Lines this rank printed (rank 0, or any rank without a store)."""
        self._alarmed: Any = None
        self._answered = 0
        self._reported = 0
        self._last_places: list[tuple[Any, ...]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="paratrain-hang")

    def start(self) -> HangWatchdog:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread; waits at most a look plus 2 s (a store call cut short is harmless)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 2.0)

    def _print(self, lines: list[str]) -> None:
        self.reports.extend(lines)
        out = self.out or sys.stderr
        for line in lines:
            print(line, file=out, flush=True)

    def _loop(self) -> None:
        # The store's timeout is left alone: it is the job's (a PrefixStore forwards it).
        # add/set/check do not wait for keys; get is called only for keys that exist.
        while not self._stop.wait(self.poll_s):
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the store went with rank 0; the job reports it
                return  # once: a store that is gone would log a native warning every look

    def tick(self, *, now: float | None = None) -> None:
        """One look: raise the alarm if stuck, answer new alarms, report on rank 0."""
        now = time.monotonic() if now is None else now
        # A long phase counts too: DDP's gradient all-reduces wait inside backward, unseen.
        current = self.recorder.current or self.recorder.phase
        start = getattr(current, "start", None) if not isinstance(current, tuple) else current[2]
        stuck = current is not None and now - start > self.warn_after_s
        if self.store is None:
            if stuck and self._alarmed is not current:
                self._alarmed = current
                self._print([f"paratrain: rank {self.rank} (host {self.host}) is "
                             f"{_where(self.recorder.snapshot(now=now), waited=True)}"])
            return
        generation = self.store.add("alarm", 0)
        if stuck and self._alarmed is not current:
            self._alarmed = current
            generation = self.store.add("alarm", 1)
        if generation > self._answered:
            # Every alarm raised since the last look (several ranks may raise one at once).
            snap = json.dumps({**self.recorder.snapshot(now=now), "host": self.host})
            for answered in range(self._answered + 1, generation + 1):
                self.store.set(f"{answered}/{self.rank}", snap)
            self._answered = generation
        if self.rank == 0 and generation > self._reported:
            self._reported = generation
            self._report(generation)

    def _report(self, generation: int) -> None:
        keys = [f"{generation}/{r}" for r in range(self.world_size)]
        # The others answer on their next tick; a rank that does not is named as silent.
        deadline = time.monotonic() + 2 * self.poll_s + 2.0
        while not self.store.check(keys) and time.monotonic() < deadline:
            time.sleep(min(self.poll_s / 2, 0.2))
        snaps: list[dict[str, Any] | None] = []
        for key in keys:
            snaps.append(json.loads(self.store.get(key)) if self.store.check([key]) else None)
        hosts = [s["host"] if s else (self.hosts[r] if r < len(self.hosts) else "")
                 for r, s in enumerate(snaps)]
        places = [_place(s) for s in snaps]
        if places != self._last_places:  # alarms raised by several ranks: one report
            self._last_places = places
            self._print(diagnose(snaps, hosts))


class HangMonitor:
    """This rank's recorder and watchdog, as a :class:`~paratrain.Run` holds them.

    Recorder and watchdog run only in a multi-rank job (a single process has no
    collectives) with ``warn_after_s > 0``; otherwise nothing is installed and
    :meth:`phase` costs a no-op context manager.
    """

    def __init__(self, *, rank: int, world_size: int, hosts: Sequence[str], warn_after_s: float,
                 store_fn: Callable[[], Any] = default_store) -> None:
        self.recorder = CollectiveRecorder()
        self.watchdog: HangWatchdog | None = None
        self.enabled = world_size > 1 and warn_after_s > 0
        self._off = contextlib.nullcontext()
        if self.enabled:
            self.recorder.install()
            self.watchdog = HangWatchdog(
                recorder=self.recorder, rank=rank, world_size=world_size, hosts=hosts,
                store=store_fn(), warn_after_s=warn_after_s).start()

    def phase(self, name: str) -> Any:
        """Context manager marking the loop phase (``forward``, ``backward``, ``step``)."""
        return self.recorder.phase_scope(name) if self.enabled else self._off

    def close(self) -> None:
        """Stop the watchdog, then restore torch.distributed's functions."""
        if self.watchdog is not None:
            self.watchdog.close()
        self.recorder.close()
