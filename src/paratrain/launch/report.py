"""What ``paratrain launch`` prints when a job ends badly: one report, not one per rank.

Workers started by the launcher record an uncaught error in torchrun's error
file instead of printing it (:mod:`paratrain.launch.worker`); the launcher
prints the traceback of the rank that failed first (none for paratrain's
one-line errors) and then one line naming that rank and how it ended.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

# torch's agent also logs each stop and failure ("Received SIGINT death signal, shutting
# down workers", "Sending process N closing signal SIGTERM", "failed (exitcode: 1)
# local_rank: ..."): the launcher's own line says it. Restarts and the rest still show.
_AGENT_LOGGERS = ("torch.distributed.elastic.multiprocessing.api",
                  "torch.distributed.elastic.agent.server.api")
_SAID_BY_LAUNCHER = ("Received %s death signal", "Sending process %s closing signal",
                     "failed (exitcode: %s)")


def _not_said_by_launcher(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_SAID_BY_LAUNCHER)


def quiet_agent_logs() -> None:
    """Drop the agent's log lines that the launcher's summary repeats (unless ``LOGLEVEL``)."""
    if os.environ.get("LOGLEVEL"):
        return
    for name in _AGENT_LOGGERS:
        logger = logging.getLogger(name)
        if _not_said_by_launcher not in logger.filters:
            logger.addFilter(_not_said_by_launcher)


def _error_data(failure: Any) -> tuple[str, str, float | None]:
    """``(message, traceback, precise time)`` from a worker's error file ('' when none)."""
    message: Any = getattr(failure, "message", "") or ""
    stack, when = "", None
    if isinstance(message, dict):  # torchrun's error-file format
        extra = message.get("extraInfo", {}) or {}
        stack = str(extra.get("py_callstack", "") or "")
        try:
            when = float(extra["paratrain_time"])
        except (KeyError, TypeError, ValueError):
            when = None
        message = message.get("message", "")
    error_file = getattr(failure, "error_file", "")
    if not (error_file and os.path.isfile(error_file)):
        return "", "", None
    return str(message).strip(), stack.strip(), when


def _order(failure: Any) -> tuple[bool, float]:
    # Ranks the agent stopped with SIGTERM after the first failure are consequences;
    # among the others the earliest error wins (sub-second when paratrain recorded it).
    stopped = failure.exitcode == -signal.SIGTERM
    when = _error_data(failure)[2]
    return stopped, when if when is not None else float(failure.timestamp)


def first_failure(exc: BaseException) -> tuple[int, Any] | None:
    """``(global rank, ProcessFailure)`` of the rank that failed first, or None."""
    failures = getattr(exc, "failures", {}) or {}
    if not failures:
        return None
    return min(failures.items(), key=lambda item: _order(item[1]))


def describe_failure(exc: BaseException) -> tuple[str, str]:
    """``(traceback, line)``: the first failed rank's traceback ('' if it left none) and one
    line naming that rank and how it ended."""
    found = first_failure(exc)
    if found is None:
        return "", f"job failed: {exc}"
    rank, failure = found
    others = len(getattr(exc, "failures", {})) - 1
    more = f" ({others} other worker(s) also failed)" if others else ""
    who = f"worker rank {rank} (local rank {failure.local_rank})"
    if failure.exitcode < 0:
        # SIGKILL (out of memory, kill -9) and SIGABRT (a C++ abort) leave no Python traceback.
        return "", (f"{who} failed first with signal {failure.signal_name()}{more}: the process "
                    "was killed and left no traceback")
    message, stack, _ = _error_data(failure)
    line = f"{who} failed first with exit code {failure.exitcode}{more}"
    if not message:
        return "", f"{line}; it recorded no error (its own output is above)"
    line = f"{line}: {message.splitlines()[0][:300]}"
    # paratrain's one-line errors record the message as their stack: nothing more to show.
    return ("" if stack == message else stack), line
