"""The contract every experiment tracker implements, and turning ``Run(loggers=...)`` into trackers.

A tracker is driven by :class:`paratrain.trackers.hub.TrackerHub` on rank 0 only, from a
background thread of its own: its client may be slow (a server round trip per call) or
fail, and neither may slow down or stop training. So the methods below are called
from that thread, one at a time, never from the training loop.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any, ClassVar

NAMES = ("mlflow", "wandb", "tensorboard")
"""The trackers ``Run(loggers=...)`` knows by name."""

EXTRA = "pip install 'paratrain[trackers]'"
"""How to get every tracker's client, named in the one-line error when one is missing."""


class Tracker:
    """One experiment tracker (MLflow, Weights & Biases, TensorBoard, or your own).

    Subclass it and implement :meth:`start`, :meth:`log` and :meth:`finish`; implement
    :meth:`state` (and read ``resume`` in :meth:`start`) for a resumed run to continue
    the same tracker run. Pass an instance in ``Run(loggers=[...])``.
    """

    name: ClassVar[str] = "tracker"
    """Short name: the key of its state in checkpoints and how warnings name it."""

    package: ClassVar[str | None] = None
    """The module its client needs (checked at ``Run()``, imported only in :meth:`start`)."""

    def start(self, *, params: dict[str, Any], directory: Path,
              resume: dict[str, Any] | None) -> dict[str, int] | None:
        """Open the tracker run and record ``params`` (the run's configuration and layout).

        ``directory`` is where an embedded store goes (under the checkpoint directory).
        ``resume`` is what :meth:`state` returned when the checkpoint being resumed was
        saved, plus ``"step"``, the checkpoint's global step: re-open that run.
        Return, for a resumed run, the last step the tracker already holds per metric
        (``{"loss": 7}``; key ``"*"`` for all metrics): steps up to it were logged
        before an interruption, and are not logged again.
        """
        raise NotImplementedError

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` (finite and non-finite floats) at optimizer step ``step``."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        """What re-opens this tracker run after a resume (saved in checkpoints)."""
        return {}

    def flush(self) -> None:
        """Make what :meth:`log` received durable (called before a checkpoint is written)."""

    def checkpoint(self, step: int | None) -> None:
        """Before a checkpoint at global ``step`` (None: unknown): every row of an earlier
        step must be durable. No later row has an earlier step; rows of ``step`` itself may
        still come. The default calls :meth:`flush`."""
        self.flush()

    def finish(self, *, failed: bool) -> None:
        """Close the tracker run; ``failed`` when the run ends with an exception."""

    def __repr__(self) -> str:
        # Stable across processes: Run's configuration check compares reprs.
        return f"{type(self).__name__}()"


def check_available(tracker: Tracker) -> None:
    """One line naming the extra to install when ``tracker``'s client package is missing."""
    package = tracker.package
    if package is not None and importlib.util.find_spec(package) is None:
        raise ValueError(f"loggers: {tracker.name!r} needs the {package} package, which is "
                         f"not installed: {EXTRA}")


def check_loggers(loggers: Any) -> None:
    """ValueError in one line for a ``loggers`` entry that is neither a name nor a Tracker."""
    names = []
    for spec in loggers:
        if not isinstance(spec, Tracker) and spec not in NAMES:
            raise ValueError(f"loggers entries must be one of {', '.join(map(repr, NAMES))} or "
                             f"a paratrain.trackers.Tracker, got {spec!r} (for a .csv or "
                             ".jsonl file use metrics_path)")
        names.append(spec if isinstance(spec, str) else spec.name)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"loggers names the tracker {twice[0]!r} twice; give each one once")
