"""Weights & Biases through its own client (``wandb.init`` / ``run.log``).

Online it needs ``wandb login`` (or ``WANDB_API_KEY``); ``WANDB_MODE=offline`` (or
``mode="offline"``) writes the run under ``<dir>/wandb/offline-run-*`` for a later
``wandb sync``. A resumed run passes the same ``id`` with ``resume="allow"``.
"""

from __future__ import annotations

import json
import struct
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
            settings=wandb.Settings(console="off"),
        )
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
        self.run.log(metrics, step=step)

    def state(self) -> dict[str, Any]:
        return {"id": self.run.id} if self.run is not None else {}

    def finish(self, *, failed: bool) -> None:
        if self.run is not None:
            self.run.finish(exit_code=1 if failed else 0)
            self.run = None

    def __repr__(self) -> str:
        return f"WandbTracker(project={self.project!r}, mode={self.mode!r})"


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
