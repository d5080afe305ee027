"""Every ``PARATRAIN_*`` environment variable, parsed once into :class:`Settings`.

``Run()`` and ``paratrain launch`` call :meth:`Settings.from_environ` once and pass the
fields down as arguments; no other module reads these variables. A bad value fails
here, at start-up, with one line naming the variable and what it must be.
:data:`VARIABLES` is the documented table (``docs/architecture.md`` prints it).

Example::

    settings = Settings.from_environ({"PARATRAIN_HEALTH_EVERY": "50"})
    assert settings.health_every == 50
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["Settings", "Straggler", "VARIABLES"]

#: field -> (variable, what it does). The order is the documented table's.
VARIABLES: dict[str, tuple[str, str]] = {
    "accelerator": ("PARATRAIN_ACCELERATOR",
                    "`cpu` or `cuda`: what `accelerator=\"auto\"` means (unset: CUDA if visible)"),
    "share_gpus": ("PARATRAIN_SHARE_GPUS",
                   "`1`: allow more processes per node than GPUs, round-robin (testing only)"),
    "timeout_s": ("PARATRAIN_TIMEOUT_S",
                  "seconds a collective waits for a peer when `Run(timeout_s=...)` is not given"),
    "wait_report_s": ("PARATRAIN_WAIT_REPORT_S",
                      "seconds between 'still waiting for ...' notices (default 30)"),
    "collective_warn_s": ("PARATRAIN_COLLECTIVE_WARN_S",
                          "seconds before a stuck collective is reported (default 60, 0 off)"),
    "health_every": ("PARATRAIN_HEALTH_EVERY",
                     "optimizer steps between cross-rank consistency checks (default 50, 0 off)"),
    "term_grace_s": ("PARATRAIN_TERM_GRACE_S",
                     "seconds the ranks have to agree on a SIGTERM/SIGINT stop (default 10)"),
    "requeue_signal": ("PARATRAIN_REQUEUE_SIGNAL",
                       "signal that saves, requeues the Slurm job and exits 0 (default `USR1`; "
                       "`0` off)"),
    "show_traceback": ("PARATRAIN_TRACEBACK",
                       "`1`: print the whole traceback instead of the one-line error"),
    "launched": ("PARATRAIN_LAUNCHED", "set to `1` by `paratrain launch` in its workers"),
    "ps_servers": ("PARATRAIN_PS_SERVERS",
                   "parameter-server ranks (set by `paratrain launch --ps-servers`)"),
    "parallel": ("PARATRAIN_PARALLEL",
                 "the layout as degrees (`dp_shard=2,tp=2`) when `Run(parallel=...)` is not given "
                 "(set by `paratrain launch --parallel`)"),
    "replica_group": ("PARATRAIN_REPLICA_GROUP",
                      "`GROUP/GROUPS`: this process's replica group of a fault-tolerant job "
                      "(set by `paratrain launch --fault-tolerant`)"),
    "lighthouse": ("PARATRAIN_LIGHTHOUSE",
                   "the torchft lighthouse's address (set by `paratrain launch --fault-tolerant`)"),
    "data_dir": ("PARATRAIN_DATA_DIR", "where `paratrain.datasets` looks for Fashion-MNIST first"),
    "kill_rank": ("PARATRAIN_KILL_RANK", "fault injection: the rank the two below apply to"),
    "kill_at_step": ("PARATRAIN_KILL_AT_STEP", "fault injection: SIGKILL after this step"),
    "term_at_step": ("PARATRAIN_TERM_AT_STEP", "fault injection: SIGTERM after this step"),
    "straggler": ("PARATRAIN_STRAGGLER",
                  "fault injection: `RANK:SECONDS[:PROBABILITY]` sleep per step (RANK or `*`)"),
}

DEFAULT_WAIT_REPORT_S = 30.0
DEFAULT_COLLECTIVE_WARN_S = 60.0
DEFAULT_HEALTH_EVERY = 50
DEFAULT_TERM_GRACE_S = 10.0


@dataclass(frozen=True, kw_only=True)
class Straggler:
    """``PARATRAIN_STRAGGLER``: ``rank`` (None for every rank) sleeps ``seconds`` per step
    with probability ``probability``."""

    rank: int | None
    seconds: float
    probability: float = 1.0


@dataclass(frozen=True, kw_only=True)
class Settings:
    """The parsed ``PARATRAIN_*`` variables (see :data:`VARIABLES` for each field's variable)."""

    accelerator: str | None = None
    share_gpus: bool | None = None
    timeout_s: float | None = None
    wait_report_s: float = DEFAULT_WAIT_REPORT_S
    collective_warn_s: float = DEFAULT_COLLECTIVE_WARN_S
    health_every: int = DEFAULT_HEALTH_EVERY
    term_grace_s: float = DEFAULT_TERM_GRACE_S
    requeue_signal: int | None = signal.SIGUSR1
    show_traceback: bool = False
    launched: bool = False
    ps_servers: int | None = None
    parallel: str | None = None
    replica_group: str | None = None
    lighthouse: str | None = None
    data_dir: str | None = None
    kill_rank: int | None = None
    kill_at_step: int | None = None
    term_at_step: int | None = None
    straggler: Straggler | None = None
    restart_count: int = 0
    max_restarts: int = 0
    """``TORCHELASTIC_RESTART_COUNT``: injected faults fire on the first attempt only."""
    slurm_job_id: str | None = None
    """``SLURM_JOB_ID``: the job rank 0 requeues on the requeue signal (None outside Slurm)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Parse ``environ`` (default ``os.environ``); ValueError naming a bad variable."""
        env = os.environ if environ is None else environ

        def raw(field: str) -> str:
            return env.get(VARIABLES[field][0], "").strip()

        accelerator = raw("accelerator") or None
        if accelerator is not None and accelerator not in ("auto", "cpu", "cuda"):
            raise ValueError(f"PARATRAIN_ACCELERATOR={accelerator!r} must be one of "
                             "('auto', 'cpu', 'cuda'); unset it or fix the value")
        return cls(
            accelerator=None if accelerator == "auto" else accelerator,
            share_gpus=_flag(env, VARIABLES["share_gpus"][0]),
            timeout_s=_seconds(env, VARIABLES["timeout_s"][0]),
            wait_report_s=_seconds(env, VARIABLES["wait_report_s"][0]) or DEFAULT_WAIT_REPORT_S,
            collective_warn_s=_warn_seconds(env),
            health_every=_count(env, VARIABLES["health_every"][0], DEFAULT_HEALTH_EVERY,
                                "(0 disables)"),
            term_grace_s=_grace(env),
            requeue_signal=_signal(env, VARIABLES["requeue_signal"][0]),
            show_traceback=raw("show_traceback") not in ("", "0"),
            launched=raw("launched") == "1",
            ps_servers=_ps_servers(env),
            parallel=raw("parallel") or None,
            replica_group=raw("replica_group") or None,
            lighthouse=raw("lighthouse") or None,
            data_dir=raw("data_dir") or None,
            kill_rank=_int(env, VARIABLES["kill_rank"][0]),
            kill_at_step=_int(env, VARIABLES["kill_at_step"][0]),
            term_at_step=_int(env, VARIABLES["term_at_step"][0]),
            straggler=_straggler(raw("straggler")),
            restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0") or 0),
            max_restarts=int(env.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0),
            slurm_job_id=env.get("SLURM_JOB_ID", "").strip() or None,
        )


def _flag(env: Mapping[str, str], name: str) -> bool | None:
    value = env.get(name, "").strip().lower()
    if value == "":
        return None
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise ValueError(f"environment variable {name}={value!r} must be 1 or 0")


def _seconds(env: Mapping[str, str], name: str) -> float | None:
    """A finite number of seconds > 0; None when unset (``inf`` would overflow the
    timeouts built from it)."""
    raw = env.get(name, "")
    if raw == "":
        return None
    try:
        value = float(raw)
        if not value > 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a number of seconds > 0") from None
    if math.isinf(value):
        raise ValueError(f"{name}={raw!r} must be a finite number of seconds > 0 "
                         "(e.g. 86400 for a day)")
    return value


def _warn_seconds(env: Mapping[str, str]) -> float:
    name = VARIABLES["collective_warn_s"][0]
    raw = env.get(name, "")
    try:
        value = DEFAULT_COLLECTIVE_WARN_S if raw == "" else float(raw)
        if not value >= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be a number of seconds >= 0 "
                         "(0 disables the stuck-collective report)") from None
    if math.isinf(value):
        raise ValueError(f"{name}={raw!r} must be a finite number of seconds >= 0 "
                         "(0 disables the stuck-collective report)")
    return value


def _grace(env: Mapping[str, str]) -> float:
    value = _seconds(env, VARIABLES["term_grace_s"][0])
    return DEFAULT_TERM_GRACE_S if value is None else value


def _signal(env: Mapping[str, str], name: str) -> int | None:
    """A signal by name (``USR1``, ``SIGUSR1``) or number; None for ``0``; default SIGUSR1."""
    raw = env.get(name, "").strip()
    if raw in ("", "USR1", "SIGUSR1"):
        return signal.SIGUSR1
    if raw in ("0", "off", "none"):
        return None
    key = raw.upper() if raw.upper().startswith("SIG") else f"SIG{raw.upper()}"
    found = int(raw) if raw.isdigit() else getattr(signal.Signals, key, None)
    if found not in {int(s) for s in signal.Signals} or found in (
            signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM, signal.SIGINT):
        raise ValueError(f"{name}={raw!r} must name a catchable signal other than TERM/INT, "
                         "e.g. USR1 or USR2 (0 turns it off)")
    return int(found)


def _count(env: Mapping[str, str], name: str, default: int, note: str) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
        if value < 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer >= 0 {note}") from None
    return value


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "")
    if raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None


def _ps_servers(env: Mapping[str, str]) -> int | None:
    name = VARIABLES["ps_servers"][0]
    value = env.get(name, "")
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{name}={value!r} must be an integer >= 1")
    return int(value)


def _straggler(value: str) -> Straggler | None:
    if not value:
        return None
    try:
        target, seconds, *rest = value.split(":")
        delay, probability = float(seconds), float(rest[0]) if rest else 1.0
        if len(rest) > 1 or delay < 0 or not 0 <= probability <= 1:
            raise ValueError
        rank = None if target == "*" else int(target)
    except ValueError:
        raise ValueError(
            f"PARATRAIN_STRAGGLER={value!r} must look like RANK:SECONDS[:PROBABILITY] "
            "(RANK an integer or *, SECONDS >= 0, PROBABILITY in [0, 1]), e.g. 1:0.05"
        ) from None
    return Straggler(rank=rank, seconds=delay, probability=probability)

