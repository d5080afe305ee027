"""TensorBoard event files, through ``torch.utils.tensorboard`` (needs the tensorboard package)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from paratrain.trackers.base import Tracker


class TensorBoardTracker(Tracker):
    """Scalars in TensorBoard event files under ``log_dir``.

    ``log_dir`` None: ``<checkpoint_dir>/trackers/tensorboard``. A resumed run writes to
    the same folder and purges the events after the checkpoint's step that an
    interrupted attempt wrote (TensorBoard's ``purge_step``), so that no step shows twice.
    """

    name = "tensorboard"
    package = "tensorboard"

    def __init__(self, log_dir: str | None = None) -> None:
        self.log_dir = log_dir
        self._writer: Any = None

    def start(self, *, params: dict[str, Any], directory: Path,
              resume: dict[str, Any] | None) -> dict[str, int] | None:
        from torch.utils.tensorboard import SummaryWriter

        if resume is not None and resume.get("log_dir"):
            self.log_dir = resume["log_dir"]
        self.log_dir = self.log_dir or str(directory / "tensorboard")
        purge = resume["step"] + 1 if resume is not None else None
        self._writer = SummaryWriter(self.log_dir, purge_step=purge)
        if resume is None:
            text = "\n".join(f"| {k} | {v} |" for k, v in params.items())
            self._writer.add_text("config", f"| parameter | value |\n|---|---|\n{text}", 0)
        return None

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(key, value, step)

    def state(self) -> dict[str, Any]:
        return {"log_dir": self.log_dir} if self.log_dir else {}

    def flush(self) -> None:
        self._writer.flush()

    def finish(self, *, failed: bool) -> None:
        if self._writer is not None:
            self._writer.close()

    def __repr__(self) -> str:
        return f"TensorBoardTracker(log_dir={self.log_dir!r})"
