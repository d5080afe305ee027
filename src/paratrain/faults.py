"""Fault injection for tests and demonstrations, driven by environment variables.

``PARATRAIN_KILL_AT_STEP=S``
    Kill this process with SIGKILL right after optimizer step ``S`` (after a
    checkpoint due at that step has been written). Only in the first attempt of
    an elastic job (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restarted
    job does not die at the same step again.
``PARATRAIN_KILL_RANK=R``
    Only rank ``R`` is killed (default: every rank).
``PARATRAIN_STRAGGLER=R:SECONDS``
    Rank ``R`` sleeps ``SECONDS`` after every optimizer step (a slow worker).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class FaultPlan:
    """The faults this rank injects; the default injects none."""

    kill_at_step: int | None = None
    delay_s: float = 0.0

    @classmethod
    def from_env(cls, *, rank: int, environ: Mapping[str, str] | None = None) -> FaultPlan:
        environ = os.environ if environ is None else environ
        kill_at = None
        if environ.get("PARATRAIN_KILL_AT_STEP"):
            target = environ.get("PARATRAIN_KILL_RANK", "")
            first_attempt = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0
            if first_attempt and (target == "" or int(target) == rank):
                kill_at = int(environ["PARATRAIN_KILL_AT_STEP"])
        delay = 0.0
        straggler = environ.get("PARATRAIN_STRAGGLER", "")
        if straggler:
            try:
                slow_rank, seconds = straggler.split(":")
                if int(slow_rank) == rank:
                    delay = float(seconds)
            except ValueError:
                raise ValueError(
                    f"PARATRAIN_STRAGGLER={straggler!r} must look like RANK:SECONDS, e.g. 1:0.05"
                ) from None
        return cls(kill_at_step=kill_at, delay_s=delay)

    def after_step(self, global_step: int) -> None:
        """Called after every optimizer step."""
        if self.delay_s:
            time.sleep(self.delay_s)
        if self.kill_at_step is not None and global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
