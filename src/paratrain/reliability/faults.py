"""Fault injection for tests and demonstrations, driven by environment variables.

``PARATRAIN_KILL_AT_STEP=S``
    Kill this process with SIGKILL right after optimizer step ``S`` (after a
    checkpoint due at that step has been written). Only in the first attempt of
    an elastic job (``TORCHELASTIC_RESTART_COUNT`` unset or 0), so a restarted
    job does not die at the same step again.
``PARATRAIN_KILL_RANK=R``
    Only rank ``R`` is killed (default: every rank).
``PARATRAIN_TERM_AT_STEP=S``
    Like ``PARATRAIN_KILL_AT_STEP`` (and limited by ``PARATRAIN_KILL_RANK``), but
    sends SIGTERM: with a checkpoint directory the job saves after the next step
    and exits with 143 (see :mod:`paratrain.reliability.signals`).
``PARATRAIN_STRAGGLER=R:SECONDS[:PROBABILITY]``
    Rank ``R`` sleeps ``SECONDS`` after every optimizer step (a slow worker). With
    ``PROBABILITY`` it sleeps after each step only with that probability (a worker
    that is slow now and then); ``R`` may be ``*`` for every rank. The draws come
    from a generator seeded with the rank, apart from the training's random state.
"""

from __future__ import annotations

import os
import random
import signal
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from paratrain.settings import Settings


@dataclass(frozen=True)
class FaultPlan:
    """The faults this rank injects; the default injects none."""

    kill_at_step: int | None = None
    term_at_step: int | None = None
    delay_s: float = 0.0
    delay_probability: float = 1.0
    # Private to this plan: drawing from the global generators would change the
    # training's data order and dropout masks.
    draws: random.Random = field(default_factory=random.Random, compare=False, repr=False)

    @classmethod
    def from_settings(cls, settings: Settings, *, rank: int) -> FaultPlan:
        """The faults ``settings`` asks of ``rank``; none after an elastic restart."""
        target = settings.kill_rank
        chosen = settings.restart_count == 0 and (target is None or target == rank)
        straggler = settings.straggler
        slow = straggler is not None and straggler.rank in (None, rank)
        return cls(kill_at_step=settings.kill_at_step if chosen else None,
                   term_at_step=settings.term_at_step if chosen else None,
                   delay_s=straggler.seconds if slow else 0.0,
                   delay_probability=straggler.probability if slow else 1.0,
                   draws=random.Random(rank))

    @classmethod
    def from_env(cls, *, rank: int, environ: Mapping[str, str] | None = None) -> FaultPlan:
        """:meth:`from_settings` with the settings parsed from ``environ``."""
        return cls.from_settings(Settings.from_environ(environ), rank=rank)

    def after_step(self, global_step: int) -> None:
        """Called after every optimizer step."""
        if self.delay_s and (self.delay_probability >= 1
                             or self.draws.random() < self.delay_probability):
            time.sleep(self.delay_s)
        if self.kill_at_step is not None and global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.term_at_step is not None and global_step == self.term_at_step:
            os.kill(os.getpid(), signal.SIGTERM)
