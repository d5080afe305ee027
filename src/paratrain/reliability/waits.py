"""Long waits say so: one line when a wait starts and one every 30 s while it lasts.

A node waiting for its master, node 0 waiting for the other nodes, and a rank
waiting for the others to join the process group can each wait minutes with
the default timeouts. :func:`reporting` prints who is waited for, how long
until the timeout and which setting changes it, so that the wait is not
mistaken for a hang. ``PARATRAIN_WAIT_REPORT_S`` sets the interval (default
30 s; tests use 1 s).
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

# A wait shorter than this is normal start-up and says nothing.
FIRST_NOTICE_S = 5.0


@contextlib.contextmanager
def reporting(line: Callable[[float], str], *, interval_s: float,
              first_after_s: float | None = None,
              done: Callable[[], bool] | None = None) -> Iterator[None]:
    """Print ``line(elapsed_s)`` to stderr while the body runs.

    The first line comes after ``first_after_s`` (default: the smaller of 5 s and
    the interval), then one every ``interval_s``. ``done``, polled twice a second,
    ends the reports early (the wait is over while the body still runs).
    """
    first = min(FIRST_NOTICE_S, interval_s) if first_after_s is None else first_after_s
    stop = threading.Event()
    started = time.monotonic()

    def report() -> None:
        due = first
        while True:
            elapsed = time.monotonic() - started
            if stop.wait(min(0.5, max(0.0, due - elapsed))):
                return
            if done is not None and done():
                return
            elapsed = time.monotonic() - started
            if elapsed >= due:
                print(line(elapsed), file=sys.stderr, flush=True)
                due += interval_s

    thread = threading.Thread(target=report, daemon=True, name="paratrain-wait-report")
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=1.0)
