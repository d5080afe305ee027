"""What a person sees: rank-0 printing, a global-sample progress bar, and a metrics log."""

from __future__ import annotations

import csv
import json
import os
import resource
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: CUDA max allocated, or peak RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is in KiB on Linux.
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MetricsLog:
    """Append rows of metrics to a ``.csv`` or ``.jsonl`` file, and optionally TensorBoard."""

    def __init__(self, path: str | None, tensorboard_dir: str | None = None) -> None:
        self.path = Path(path) if path else None
        self._columns: list[str] | None = None
        self._rows: list[dict[str, Any]] = []
        self._writer = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ValueError(
                    "tensorboard_dir needs the tensorboard package: pip install tensorboard"
                ) from None
            self._writer = SummaryWriter(tensorboard_dir)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict[str, Any], *, step: int) -> None:
        row = {"step": step, **{k: _plain(v) for k, v in row.items()}}
        if self.path is not None and self.path.suffix == ".jsonl":
            with self.path.open("a") as f:
                f.write(json.dumps(row) + "\n")
        elif self.path is not None:
            self._write_csv(row)
        if self._writer is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._writer.add_scalar(key, value, step)

    def _write_csv(self, row: dict[str, Any]) -> None:
        self._rows.append(row)
        new_columns = [k for k in row if k not in (self._columns or [])]
        if self._columns is None or new_columns:
            # A new column appeared: rewrite the file so the header covers every row.
            self._columns = [*(self._columns or []), *new_columns]
            rows, mode = self._rows, "w"
        else:
            rows, mode = [row], "a"
        with self.path.open(mode, newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self._columns)
            if mode == "w":
                writer.writeheader()
            writer.writerows(rows)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _plain(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


class Reporter:
    """Printing and progress on the main rank only; other ranks stay silent."""

    def __init__(self, *, is_main: bool, show_progress: bool, metrics: MetricsLog | None) -> None:
        self.is_main = is_main
        self.show_progress = show_progress and is_main
        self.metrics = metrics
        self._bar: tqdm | None = None

    def print(self, *args: Any, **kwargs: Any) -> None:
        if not self.is_main:
            return
        if self._bar is not None:
            tqdm.write(" ".join(str(a) for a in args), file=sys.stdout)
        else:
            print(*args, **kwargs, flush=True)

    def log(self, row: dict[str, Any], *, step: int) -> None:
        if self.is_main and self.metrics is not None:
            self.metrics.write(row, step=step)

    def progress(
        self, batches: Iterable[Any], *, total_samples: int, samples_per_batch: int, desc: str
    ) -> Iterator[Any]:
        """Yield ``batches``; on the main rank show global samples and samples/s."""
        if not self.show_progress:
            yield from batches
            return
        interactive = sys.stderr.isatty()
        bar = tqdm(
            total=total_samples,
            desc=desc,
            unit="sample",
            unit_scale=True,
            dynamic_ncols=True,
            # In logs (no terminal) a line every 30 s is enough.
            mininterval=0.1 if interactive else 30.0,
            leave=interactive,
        )
        self._bar = bar
        start = time.perf_counter()
        done = 0
        try:
            for batch in batches:
                yield batch
                step = min(samples_per_batch, total_samples - done)
                done += step
                bar.update(step)
                elapsed = time.perf_counter() - start
                if elapsed > 0:
                    bar.set_postfix_str(f"{done / elapsed:,.0f} samples/s", refresh=False)
        finally:
            bar.close()
            self._bar = None

    def close(self) -> None:
        if self._bar is not None:
            # Closed now, not when the loop's generator is collected (after later output).
            self._bar.close()
            self._bar = None
        if self.metrics is not None:
            self.metrics.close()


def cpu_threads_per_process(local_world_size: int) -> int:
    """Cores divided evenly among the processes of a node, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, local_world_size))
