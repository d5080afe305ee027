"""Weights & Biases through its own client (``wandb.init`` / ``run.log``).

Online it needs ``wandb login`` (or ``WANDB_API_KEY``); ``WANDB_MODE=offline`` (or
``mode="offline"``) writes the run under ``<dir>/wandb/offline-run-*`` for a later
``wandb sync``. A resumed run passes the same ``id`` with ``resume="allow"``.

Checkpoints: W&B keeps the newest step's row open (a later row may join it) and its
service writes the run's ``.wandb`` file every few seconds, so a SIGKILL lost every row
since the last write. Here rows are merged per step and sent when the step advances;
before a checkpoint at step S the open row of an earlier step is sent too, and the
checkpoint waits until the ``.wandb`` file holds it (written every 0.25 s), so every
step before S survives a SIGKILL, offline and online.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

from paratrain.trackers.base import Tracker


class WandbTracker(Tracker):
    """Log to Weights & Biases: the configuration as the run's config, metrics with the step.

    Args:
        project: the W&B project.
        entity: the team or user (W&B's default when None).
        name: the run's display name.
        mode: ``online``, ``offline`` or ``disabled``; None: ``WANDB_MODE``, else online.
        dir: where W&B writes its files; None: ``<checkpoint_dir>/trackers``.
        tags: the run's tags.
    """

    name = "wandb"
    package = "wandb"

    def __init__(self, project: str = "paratrain", *, entity: str | None = None,
                 name: str | None = None, mode: str | None = None, dir: str | None = None,
                 tags: list[str] | None = None) -> None:
        self.project = project
        self.entity = entity
        self.run_name = name
        self.mode = mode
        self.dir = dir
        self.tags = list(tags or [])
        self.run: Any = None
        self._open: tuple[int, dict[str, float]] | None = None  # (step, row) not yet sent
        self._sent = -1  # the last step sent to W&B

    durable_within_s = 20.0
    """How long a checkpoint waits for W&B's service to write the rows before it."""

    flush_interval_s = 0.25
    """How often W&B's service writes its ``.wandb`` file (its default is 15 s)."""

    def start(self, *, params: dict[str, Any], directory: Path,
              resume: dict[str, Any] | None) -> dict[str, int] | None:
        import wandb

        root = Path(self.dir) if self.dir else directory
        root.mkdir(parents=True, exist_ok=True)
        resumed = resume is not None and resume.get("id")
        self.run = wandb.init(
            project=self.project, entity=self.entity, name=self.run_name, mode=self.mode,
            dir=str(root), tags=self.tags or None, config=params,
            id=resume["id"] if resumed else None, resume="allow" if resumed else None,
            # Training prints its own lines; W&B must not take over stdout/stderr.
            settings=_settings(wandb, console="off",
                               x_transaction_log_flush_interval=self.flush_interval_s),
        )
        self._open, self._sent = None, -1
        if not resumed:
            return None
        # Offline, earlier attempts of this run are other folders, read back per metric
        # (a row may still join the step where the attempt stopped); online, W&B
        # continues after the last step it holds and refuses rows before it.
        current = Path(self.run.dir).parent
        marks: dict[str, int] = {}
        for path in offline_files(root, self.run.id):
            if path.parent != current:
                for key, step in last_steps(path).items():
                    marks[key] = max(step, marks.get(key, -1))
        starting = int(getattr(self.run, "starting_step", 0) or 0)
        if starting > 0:
            marks["*"] = starting - 1
        return marks or None

    def log(self, metrics: dict[str, float], step: int) -> None:
        if self._open is not None and self._open[0] == step:
            self._open[1].update(metrics)
            return
        self._send()
        self._open = (step, dict(metrics))

    def _send(self) -> None:
        """Send the open row, committed: W&B's client then hands it to its service."""
        if self._open is not None:
            step, row = self._open
            self.run.log(row, step=step, commit=True)
            self._sent, self._open = step, None

    def checkpoint(self, step: int | None) -> None:
        """Send the open row when it is of a step before ``step`` (no row of it can come
        any more), then wait until the run's ``.wandb`` file holds every sent step."""
        if self._open is not None and step is not None and self._open[0] < step:
            self._send()
        if self._sent < 0:
            return
        path = Path(self.run.dir).parent / f"run-{self.run.id}.wandb"
        deadline = time.monotonic() + self.durable_within_s
        while path.exists():  # absent: W&B writes no transaction log (x_skip_transaction_log)
            written = [s for s, _ in history(path)]
            if written and written[-1] >= self._sent:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"W&B did not write step {self._sent} to {path} within "
                                   f"{self.durable_within_s:g} s before a checkpoint")
            time.sleep(0.05)

    def state(self) -> dict[str, Any]:
        return {"id": self.run.id} if self.run is not None else {}

    def finish(self, *, failed: bool) -> None:
        if self.run is not None:
            self._send()
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None

    def __repr__(self) -> str:
        return f"WandbTracker(project={self.project!r}, mode={self.mode!r})"


def _settings(wandb: Any, **fields: Any) -> Any:
    """``wandb.Settings(**fields)``, leaving out the flush interval where the installed
    client has no such setting (before W&B 0.22)."""
    try:
        return wandb.Settings(**fields)
    except Exception:  # noqa: BLE001 - pydantic's ValidationError for an unknown field
        fields.pop("x_transaction_log_flush_interval", None)
        return wandb.Settings(**fields)


def offline_files(root: str | Path, run_id: str) -> list[Path]:
    """The record files of every offline attempt of run ``run_id`` under ``root``, oldest first."""
    return sorted(Path(root).glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))


def records(path: str | Path) -> list[Any]:
    """The protobuf records (``wandb_internal_pb2.Record``) of an offline W&B record file."""
    from wandb.proto import wandb_internal_pb2

    found = []
    for data in _records(Path(path).read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        found.append(record)
    return found


def history(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """``(step, {key: value})`` of each history row in an offline W&B record file."""
    return [(int(r.history.step.num),
             {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def last_steps(path: str | Path) -> dict[str, int]:
    """The last history step of each metric in an offline record file."""
    found: dict[str, int] = {}
    for step, row in history(path):
        for key in row:
            found[key] = max(step, found.get(key, -1))
    return found


# W&B's record file: a 7-byte header, then LevelDB log blocks of 32 KiB whose records
# have a 7-byte header (checksum, length, type: 1 whole, 2 first, 3 middle, 4 last part).
_BLOCK, _HEADER = 32768, 7


def _records(data: bytes) -> list[bytes]:
    if data[:4] != b":W&B":
        raise ValueError("not a W&B record file")
    records, parts, pos = [], b"", _HEADER
    while pos + _HEADER <= len(data):
        if _BLOCK - pos % _BLOCK < _HEADER:  # the block's zero padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        chunk = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0:  # preallocated, unwritten space: the end of what was flushed
            break
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            records.append(parts)
            parts = b""
    return records
