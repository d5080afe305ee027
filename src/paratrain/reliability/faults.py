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
    def from_env(cls, *, rank: int, environ: Mapping[str, str] | None = None) -> FaultPlan:
        environ = os.environ if environ is None else environ
        target = _int(environ, "PARATRAIN_KILL_RANK")
        first_attempt = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) == 0
        chosen = first_attempt and (target is None or target == rank)
        kill_at = _int(environ, "PARATRAIN_KILL_AT_STEP") if chosen else None
        term_at = _int(environ, "PARATRAIN_TERM_AT_STEP") if chosen else None
        delay, probability = _straggler(environ.get("PARATRAIN_STRAGGLER", ""), rank)
        return cls(kill_at_step=kill_at, term_at_step=term_at, delay_s=delay,
                   delay_probability=probability, draws=random.Random(rank))

    def after_step(self, global_step: int) -> None:
        """Called after every optimizer step."""
        if self.delay_s and (self.delay_probability >= 1
                             or self.draws.random() < self.delay_probability):
            time.sleep(self.delay_s)
        if self.kill_at_step is not None and global_step == self.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.term_at_step is not None and global_step == self.term_at_step:
            os.kill(os.getpid(), signal.SIGTERM)


def _int(environ: Mapping[str, str], name: str) -> int | None:
    raw = environ.get(name, "")
    if raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None


def _straggler(value: str, rank: int) -> tuple[float, float]:
    """``(seconds, probability)`` this rank sleeps per step under ``PARATRAIN_STRAGGLER``."""
    if not value:
        return 0.0, 1.0
    try:
        target, seconds, *rest = value.split(":")
        delay, probability = float(seconds), float(rest[0]) if rest else 1.0
        if len(rest) > 1 or delay < 0 or not 0 <= probability <= 1:
            raise ValueError
        chosen = target == "*" or int(target) == rank
    except ValueError:
        raise ValueError(
            f"PARATRAIN_STRAGGLER={value!r} must look like RANK:SECONDS[:PROBABILITY] "
            "(RANK an integer or *, SECONDS >= 0, PROBABILITY in [0, 1]), e.g. 1:0.05"
        ) from None
    return (delay, probability) if chosen else (0.0, 1.0)
