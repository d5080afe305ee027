"""What runs after every optimizer step, as a chain of small hooks.

The order is fixed and matters: injected faults first (a test kills a rank right after
the step it names), then the cross-rank health check, the straggler check, the periodic
checkpoint, and last the agreed SIGTERM/SIGINT stop, which saves (once) and exits.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from paratrain.data.loader import DataCursor
from paratrain.reliability.faults import FaultPlan
from paratrain.reliability.health import HealthMonitor
from paratrain.reliability.signals import GracefulStop
from paratrain.reliability.stragglers import StragglerDetector

__all__ = ["AfterStep", "FaultHook", "HealthHook", "PeriodicSave", "StopOnSignal",
           "StragglerHook"]


class AfterStep(Protocol):
    """Called with the new global step and the data position after every optimizer step."""

    def __call__(self, global_step: int, cursor: DataCursor) -> None: ...


@dataclass
class FaultHook:
    """Injected faults (``PARATRAIN_KILL_AT_STEP`` and friends) for tests and demos."""

    plan: FaultPlan

    def __call__(self, global_step: int, cursor: DataCursor) -> None:
        self.plan.after_step(global_step)


@dataclass
class HealthHook:
    """Every ``health_every`` steps: do all ranks agree on step, data position and model?"""

    monitor: HealthMonitor

    def __call__(self, global_step: int, cursor: DataCursor) -> None:
        self.monitor.after_step(global_step=global_step, epoch=cursor.epoch,
                                offset=cursor.offset)


@dataclass
class StragglerHook:
    """Time the step and its loader wait; every ``check_every`` steps name a slow rank."""

    detector: StragglerDetector
    loader: Callable[[], Any]
    """The training loader now (None before ``run.loader``), whose wait this step took."""

    def __call__(self, global_step: int, cursor: DataCursor) -> None:
        loader = self.loader()
        waited = loader.take_wait() if loader is not None else 0.0
        self.detector.after_step(global_step, waited)


@dataclass
class PeriodicSave:
    """A checkpoint every ``every`` optimizer steps (``RunConfig.checkpoint_every``)."""

    every: int | None
    save: Callable[[], object]

    def __call__(self, global_step: int, cursor: DataCursor) -> None:
        if self.every and global_step % self.every == 0:
            self.save()


@dataclass
class StopOnSignal:
    """After an agreed SIGTERM/SIGINT (or requeue signal) every rank saves this same step
    and exits; on the requeue signal rank 0 first requeues the Slurm job.

    ``save`` writes a step's checkpoint at most once, so a periodic save at the same
    step is not repeated.
    """

    stop: GracefulStop
    save: Callable[[], object]
    close: Callable[[], None]
    print_fn: Callable[[str], None]
    checkpoint_dir: str | None

    def __call__(self, global_step: int, cursor: DataCursor) -> None:
        if not self.stop.should_stop():
            return
        self.save()
        # close() ends the progress bar first, so that it is not redrawn after the line.
        self.close()
        requeued = self.stop.after_save()  # the requeue signal: rank 0 requeues the Slurm job
        self.print_fn(f"paratrain: {self.stop.signal.name} received; saved step "
                      f"{global_step} to {self.checkpoint_dir}{requeued}, exiting")
        raise SystemExit(self.stop.exit_code)
