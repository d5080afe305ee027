"""Name the collective ``Run`` method that one rank called and its peers did not.

``if run.rank == 0: run.save()`` reads naturally, but ``save`` gathers every rank's
RNG state: rank 0 waits in it while rank 1 goes on, closes its group and exits, and
rank 0 ends with gloo's "Connection closed by peer ... remote worker crashing" (or,
under NCCL, is aborted at the timeout with no traceback). Here it ends with one line::

    rank 0 called run.save() but rank 1 did not (it called run.close()); ...

How, without communicating per call: each rank counts, locally, the collective methods
it enters (:data:`COLLECTIVE`; calls nested in another, like a periodic save inside
``run.step``, are not counted). ``run.close()`` (or the end of a process that never
called it) writes ``<how> <count>`` into the job's store. A rank whose collective
method fails, or waits while a peer has ended after fewer calls than it made, reads
those entries: a peer that ended before entering this call never will.

Only for lockstep strategies (every rank holds a replica or shard of the model): under
pipeline stages and parameter servers ranks call different methods by design.
"""

from __future__ import annotations

import atexit
import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from paratrain.distributed import _compat
from paratrain.reliability.health import HealthError

COLLECTIVE = ("prepare", "evaluate", "mean", "sum", "gather", "save", "save_pretrained",
              "load_pretrained")
"""``Run`` methods that communicate with every rank (``load`` is local under ddp, and a
rank-0 ``load`` would make the counts differ, so it is not counted)."""
_LIST = ("run.prepare(), run.evaluate(), run.mean(), run.sum(), run.gather() and run.save() "
         "are collective: call them on every rank (only printing belongs under "
         "`if run.is_main`)")
_ENDED = {"closed": "called run.close()", "finished": "finished without run.close()"}
_STORE_WAIT_S = 2.0
_POLL_S = 1.0
# How long a call may wait after a peer announced its end before the watcher ends this
# process: a peer's close takes a few seconds (its monitors stop) before its group goes,
# which makes this rank's collective fail by itself, in the main thread, with this line.
_GRACE_S = 15.0


class CollectiveMisuseError(HealthError):
    """A collective ``Run`` method ran on some ranks only (a one-line error, like HealthError)."""


def _store_call(fn: Callable[[Any], Any]) -> Any:
    """``fn(store)`` on this group's ``paratrain/ended`` keys, at most ~2 s; None if it fails.

    In a thread: a store behind a dead rank 0 can block until the job's timeout. That
    timeout is left alone (a PrefixStore forwards it to the job's store, which the group
    uses too): check and set do not wait for keys, and get is called for keys that exist.
    """
    answer: dict[str, Any] = {}

    def call() -> None:
        try:
            store = dist.PrefixStore("paratrain/ended", _compat.default_store())
            answer["value"] = fn(store)
        except Exception:  # noqa: BLE001 - no store, or it went away: nothing to say
            return

    thread = threading.Thread(target=call, daemon=True, name="paratrain-ended")
    thread.start()
    thread.join(_STORE_WAIT_S + 1.0)
    return answer.get("value")


class CollectiveCalls:
    """This rank's count of collective ``Run`` calls, its announcement at the end, and the
    one line naming a call its peers never made.

    Args:
        rank, world_size: this process's place.
        timeout_s: the collective timeout; the watcher acts well before it.
    """

    def __init__(self, *, rank: int, world_size: int, timeout_s: float) -> None:
        self.rank, self.world_size = rank, world_size
        self.grace_s = min(_GRACE_S, timeout_s / 2)
        self.count = 0
        self.current: str | None = None
        """The outermost collective method this rank is in (None: none)."""
        self._ended = False
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        atexit.register(self._at_exit)

    # -- calls ----------------------------------------------------------------------
    def call(self, name: str, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``method`` as collective call ``name``; a failure its peers caused is one line."""
        if self.current is not None:  # nested (a save inside run.step's periodic save)
            return method(*args, **kwargs)
        self.count += 1
        self.current = name
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name="paratrain-collective-calls")
            self._watcher.start()
        try:
            return method(*args, **kwargs)
        except RuntimeError as exc:
            line = self.diagnose()
            if line is None:
                raise
            raise CollectiveMisuseError(line) from exc
        finally:
            self.current = None

    def diagnose(self) -> str | None:
        """The one line when a peer ended before this call (None: none did)."""
        name, count = self.current, self.count
        ended = _store_call(self._read_peers)
        if not ended or name is None:
            return None
        missing = {r: how for r, (how, calls) in ended.items() if calls < count}
        if not missing:
            return None
        ranks = sorted(missing)
        who = (f"rank {ranks[0]}" if len(ranks) == 1
               else "ranks " + ", ".join(map(str, ranks)))
        hows = sorted({_ENDED[h] for h in missing.values()})
        subject = "it" if len(ranks) == 1 else "they"
        return (f"rank {self.rank} called run.{name}() but {who} did not ({subject} "
                f"{' or '.join(hows)}); {_LIST}")

    def _read_peers(self, store: Any) -> dict[int, tuple[str, int]]:
        found: dict[int, tuple[str, int]] = {}
        if store.add("count", 0) == 0:  # one request while no rank has ended (each second)
            return found
        for r in range(self.world_size):
            if r != self.rank and store.check([str(r)]):
                how, _, calls = store.get(str(r)).decode().partition(" ")
                if how in _ENDED:
                    found[r] = (how, int(calls))
        return found

    def _watch(self) -> None:
        # A peer that ended does not always break this rank's collective: under NCCL, or
        # when its group outlives its Run, the collective would wait for the timeout and
        # NCCL's watchdog would abort without a word. Looks at the store only while a call
        # is in progress, once a second.
        while not self._stop.wait(_POLL_S):
            if self.current is None:
                continue
            count = self.count
            line = self.diagnose()
            if line is None or self._stop.wait(self.grace_s) or self.count != count \
                    or self.current is None:
                continue  # the failed collective raised first, in the main thread
            error = CollectiveMisuseError(line)
            sys.excepthook(CollectiveMisuseError, error, None)  # one line, or the error file
            sys.stderr.flush()
            os._exit(1)

    # -- the end ----------------------------------------------------------------------
    def announce(self, how: str) -> None:
        """Write ``how`` (closed, finished, failed) and the call count, once, and stop."""
        self._stop.set()
        atexit.unregister(self._at_exit)
        if self._ended:
            return
        self._ended = True

        def write(store: Any) -> None:
            store.set(str(self.rank), f"{how} {self.count}")
            store.add("count", 1)

        _store_call(write)

    def _at_exit(self) -> None:
        from paratrain.reliability.signals import error_reported

        self.announce("failed" if error_reported() else "finished")


def tracked(cls: type) -> type:
    """Class decorator for ``Run``: count :data:`COLLECTIVE` calls, announce at ``close``."""
    for name in COLLECTIVE:
        setattr(cls, name, _counted(name, getattr(cls, name)))
    original_close = cls.close

    @functools.wraps(original_close)
    def close(self: Any) -> None:
        calls = _calls_of(self)
        if calls is not None and not self._closed:
            # Before the group goes: a peer failing in a call this rank never made reads it.
            calls.announce("failed" if sys.exc_info()[1] is not None else "closed")
        original_close(self)

    cls.close = close
    return cls


def _counted(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls = _calls_of(self)
        if calls is None:
            return method(self, *args, **kwargs)
        try:
            return calls.call(name, method, self, *args, **kwargs)
        except CollectiveMisuseError:
            self._peer_lost = True  # close() then waits for no peer
            raise

    return wrapper


def _calls_of(run: Any) -> CollectiveCalls | None:
    """The run's :class:`CollectiveCalls`, made at its first call; None when not lockstep."""
    calls = run.__dict__.get("_collective_calls", False)
    if calls is False:
        lockstep = run.world_size > 1 and run.strategy.data_parallel_size == run.world_size
        calls = (CollectiveCalls(rank=run.rank, world_size=run.world_size,
                                 timeout_s=run.config.timeout_s) if lockstep else None)
        run.__dict__["_collective_calls"] = calls
    return calls
