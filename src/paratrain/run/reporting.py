"""What a person sees: rank-0 printing, a global-sample progress bar, and a metrics log."""

from __future__ import annotations

import csv
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import torch
from tqdm.auto import tqdm

if TYPE_CHECKING:
    from paratrain.trackers.hub import TrackerHub


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
                # default=str: a value JSON has no type for is written as its text, as in CSV.
                f.write(json.dumps(row, default=str) + "\n")
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
    """A Python number for a one-element tensor or a NumPy scalar/array (JSON cannot
    write ``np.float32``); anything else as it is."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    if isinstance(value, (np.ndarray, np.generic)) and value.size == 1:
        return value.item()
    return value


class Reporter:
    """Printing and progress on the main rank only; other ranks stay silent.

    On a terminal the progress is a tqdm bar; in a log file (stderr not a
    terminal) it is one plain line every ``log_interval_s`` and one at the end.
    """

    def __init__(self, *, is_main: bool, show_progress: bool, metrics: MetricsLog | None,
                 stream: TextIO | None = None, log_interval_s: float = 30.0,
                 trackers: TrackerHub | None = None) -> None:
        self.is_main = is_main
        self.show_progress = show_progress and is_main
        self.metrics = metrics
        self.trackers = trackers
        """Experiment trackers (``RunConfig.loggers``), fed on the main rank only."""
        self.stream = stream
        self.log_interval_s = log_interval_s
        self._bar: tqdm | None = None

    def print(self, *args: Any, sep: str | None = " ", end: str | None = "\n",
              file: Any = None, flush: bool = True) -> None:
        """``print`` on the main rank (its keyword arguments too), above a progress bar."""
        if not self.is_main:
            return
        if self._bar is not None:
            text = (" " if sep is None else sep).join(str(a) for a in args)
            tqdm.write(text, file=file or sys.stdout, end="\n" if end is None else end)
        else:
            # flush: the rank-0 lines interleave with other ranks' output in one log.
            print(*args, sep=sep, end=end, file=file, flush=flush)

    def log(self, row: dict[str, Any], *, step: int,
            live: Callable[[], dict[str, Any]] | None = None) -> None:
        """Write ``row`` to the metrics log; trackers also get ``live()`` (current rates)."""
        if self.is_main and self.metrics is not None:
            self.metrics.write(row, step=step)
        if self.is_main and self.trackers:
            self.trackers.log({**row, **live()} if live is not None else row, step=step)

    def progress(
        self, batches: Iterable[Any], *, total_samples: int, samples_per_batch: int, desc: str,
        rates: Callable[[float], dict[str, float | None]] | None = None,
    ) -> Iterator[Any]:
        """Yield ``batches``; on the main rank show global samples, samples/s and ``rates``.

        ``rates(samples_per_s)`` adds derived figures (tokens/s, TFLOP/s, MFU; see
        :class:`paratrain.run.flops.Throughput`) after the speed.
        """
        if not self.show_progress:
            yield from batches
            return
        stream = self.stream or sys.stderr
        meter = _Meter(total_samples, samples_per_batch, rates)
        if _isatty(stream):
            yield from self._bar_progress(batches, meter, desc=desc, stream=stream)
        else:
            yield from self._line_progress(batches, meter, desc=desc, stream=stream)

    def _bar_progress(self, batches: Iterable[Any], meter: _Meter, *, desc: str,
                      stream: TextIO) -> Iterator[Any]:
        bar = tqdm(
            total=meter.total, desc=desc, unit="sample", unit_scale=True, dynamic_ncols=True,
            mininterval=0.1, file=stream,
            # tqdm's own rate is left out: the postfix shows the speed once, with rates.
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}{postfix}]",
        )
        self._bar = bar
        try:
            for batch in batches:
                yield batch
                bar.update(meter.advance())
                bar.set_postfix_str(meter.describe(), refresh=False)
        finally:
            bar.close()
            self._bar = None

    def _line_progress(self, batches: Iterable[Any], meter: _Meter, *, desc: str,
                       stream: TextIO) -> Iterator[Any]:
        # A log file keeps every byte: no carriage-return redraws, no 0% line and no
        # line of spaces to erase the bar, only complete lines.
        last = meter.start
        try:
            for batch in batches:
                yield batch
                meter.advance()
                if meter.done < meter.total and time.perf_counter() - last >= self.log_interval_s:
                    last = time.perf_counter()
                    print(meter.line(desc), file=stream, flush=True)
        finally:
            print(meter.line(desc), file=stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            # Closed now, not when the loop's generator is collected (after later output).
            self._bar.close()
            self._bar = None
        if self.metrics is not None:
            self.metrics.close()
        if self.trackers is not None:
            self.trackers.close()


class _Meter:
    """Samples done, the average speed since the start and its one-line description."""

    def __init__(self, total: int, per_batch: int,
                 rates: Callable[[float], dict[str, float | None]] | None) -> None:
        self.total = total
        self.per_batch = per_batch
        self.rates = rates
        self.done = 0
        self.start = time.perf_counter()

    def advance(self) -> int:
        step = min(self.per_batch, self.total - self.done)
        self.done += step
        return step

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def describe(self) -> str:
        elapsed = self.elapsed()
        speed = self.done / elapsed if elapsed > 0 else 0.0
        return ", ".join([f"{speed:,.0f} samples/s",
                          *format_rates(self.rates(speed) if self.rates else {})])

    def line(self, desc: str) -> str:
        percent = 100 * self.done // self.total if self.total else 100
        return (f"{desc}: {self.done:,}/{self.total:,} samples ({percent}%) in "
                f"{tqdm.format_interval(self.elapsed())}, {self.describe()}")


def format_rates(rates: dict[str, float | None]) -> list[str]:
    """Bar forms of :meth:`paratrain.run.flops.Throughput.rates`: ``1.23M tokens/s``, ``MFU 41.0%``."""
    parts = []
    if rates.get("tokens_per_s") is not None:
        parts.append(f"{tqdm.format_sizeof(rates['tokens_per_s'])} tokens/s")
    if rates.get("tflops_per_device") is not None:
        parts.append(f"{tqdm.format_sizeof(rates['tflops_per_device'] * 1e12)}FLOP/s")
    if "mfu" in rates:
        parts.append("MFU n/a" if rates["mfu"] is None else f"MFU {100 * rates['mfu']:.1f}%")
    if rates.get("skipped_steps"):  # optimizer steps without an update (RunConfig.nan)
        parts.append(f"skipped={rates['skipped_steps']}")
    if rates.get("straggler") is not None:  # a named slow rank (RunConfig.stragglers)
        parts.append(f"straggler=rank {rates['straggler']}")
    return parts


def _isatty(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
