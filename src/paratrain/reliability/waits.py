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
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping

ENV_INTERVAL = "PARATRAIN_WAIT_REPORT_S"
DEFAULT_INTERVAL_S = 30.0
# A wait shorter than this is normal start-up and says nothing.
FIRST_NOTICE_S = 5.0


def seconds_from_env(name: str, environ: Mapping[str, str] | None = None) -> float | None:
    """A positive number of seconds from the variable ``name``; None when it is unset.

    A value that is not a number > 0 is a ValueError naming the variable.
    """
    environ = os.environ if environ is None else environ
    raw = environ.get(name, "")
    if raw == "":
        return None
    try:
        value = float(raw)
        if not value > 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a number of seconds > 0") from None
    return value


def report_interval(environ: Mapping[str, str] | None = None) -> float:
    """Seconds between wait notices, from ``PARATRAIN_WAIT_REPORT_S`` (default 30)."""
    value = seconds_from_env(ENV_INTERVAL, environ)
    return DEFAULT_INTERVAL_S if value is None else value


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
