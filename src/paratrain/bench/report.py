"""Rows of ``paratrain bench``: aggregated from per-rank results, shown as table/JSON/CSV/PNG."""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from paratrain.units import format_bytes, format_seconds

NOISY_SPREAD = 0.10
"""A row whose timing windows' throughput spans more than this fraction of its median
is ``noisy``: something else used the machine while it ran, so differences between
rows of that size are not measured."""
SUPERLINEAR = 1.05
"""Scaling efficiency above this is flagged, never shown as a plain number: N
processes on one machine do not beat N times one process by more than noise, so the
baseline was measured slow (or the row fast) by something outside the strategy."""


@dataclass(kw_only=True)
class BenchRow:
    """One strategy at one precision and world size. Times in seconds, memory in bytes per rank
    (on CUDA the GPU memory of the caching allocator)."""

    strategy: str
    world_size: int
    precision: str = "32"
    device: str = ""  # cpu, cuda:0, ...
    status: str = "ok"  # ok, skipped or failed
    reason: str = ""
    note: str = ""
    num_processes: int = 0  # launched processes, servers included
    samples_per_step: int = 0
    samples_per_s: float | None = None  # median over repeats
    samples_per_s_min: float | None = None
    samples_per_s_max: float | None = None
    step_time_s: float | None = None
    compute_time_s: float | None = None  # forward + backward without gradient sync
    optimizer_step_s: float | None = None
    exposed_comm_share: float | None = None
    seconds_per_epoch: float | None = None
    peak_memory_bytes: int | None = None  # max over ranks, above each rank's baseline
    peak_memory_per_rank: list[int] = field(default_factory=list)
    param_bytes: int | None = None
    grad_bytes: int | None = None
    optimizer_bytes: int | None = None
    cpu_percent: float | None = None  # mean over ranks, 100 = one core busy
    system_cpu_percent: float | None = None
    gpu_percent: float | None = None  # NVML utilisation, mean over ranks
    gpu_note: str = ""  # why gpu_percent is missing on CUDA, e.g. "n/a (install nvidia-ml-py)"
    scaling_efficiency: float | None = None
    noisy: bool = False  # timing windows spread more than NOISY_SPREAD (see there)
    efficiency_flag: str = ""  # why scaling_efficiency is not to be trusted, or ""
    link_bus_bandwidth: float | None = None  # bytes/s, from the optional link probe
    link_latency_s: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def label(self) -> str:
        """The row's name: ``ddp`` at float32, ``ddp+bf16-mixed`` otherwise."""
        return self.strategy if self.precision == "32" else f"{self.strategy}+{self.precision}"

    def gpu_text(self) -> str:
        """GPU utilisation for the table: a percentage, why it is missing, or "-" off CUDA."""
        if self.gpu_percent is not None:
            return f"{self.gpu_percent:.0f}"
        return self.gpu_note or "-"


def _mean(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def row_from_results(strategy: str, world_size: int, results: list[dict[str, Any]], *,
                     epoch_samples: int, num_processes: int, note: str = "",
                     precision: str = "32") -> BenchRow:
    """Aggregate the per-rank JSON of one job (see :mod:`paratrain.bench.worker`).

    The step times are already the maximum over ranks; throughput per window is
    ``samples_per_step / step_time``; the exposed communication is what the synced step
    takes beyond forward + backward without sync and a local optimizer step.
    """
    first = results[0]
    samples = first["samples_per_step"]
    speeds = [samples / t for t in first["step_s"]]
    step = statistics.median(first["step_s"])
    compute = statistics.median(first["compute_step_s"])
    opt = first["optimizer_step_s"]
    median_speed = statistics.median(speeds)
    noisy = (max(speeds) - min(speeds)) > NOISY_SPREAD * median_speed
    notes = [n for n in (note, first.get("notice")) if n]
    bus, latency = link_from_probe(first)
    return BenchRow(
        strategy=strategy, world_size=world_size, precision=precision,
        device=first.get("device", ""), note="; ".join(notes),
        num_processes=num_processes, samples_per_step=samples, samples_per_s=median_speed,
        samples_per_s_min=min(speeds), samples_per_s_max=max(speeds), noisy=noisy,
        step_time_s=step,
        compute_time_s=compute, optimizer_step_s=opt,
        exposed_comm_share=max(0.0, step - compute - opt) / step,
        seconds_per_epoch=epoch_samples / median_speed,
        peak_memory_bytes=max(r["peak_memory_above_baseline_bytes"] for r in results),
        peak_memory_per_rank=[r["peak_memory_above_baseline_bytes"] for r in results],
        param_bytes=max(r["param_bytes"] for r in results),
        grad_bytes=max(r["grad_bytes"] for r in results),
        optimizer_bytes=max(r["optimizer_bytes"] for r in results),
        cpu_percent=_mean([r.get("cpu_percent") for r in results]),
        system_cpu_percent=_mean([r.get("system_cpu_percent") for r in results]),
        gpu_percent=_mean([r.get("gpu_percent") for r in results]),
        gpu_note=next((r["gpu_note"] for r in results if r.get("gpu_note")), ""),
        link_bus_bandwidth=bus, link_latency_s=latency,
    )


def link_from_probe(result: dict) -> tuple[float | None, float | None]:
    """``(bus bandwidth in bytes/s, latency per hop in s)`` from a rank's link probe.

    A ring all-reduce of ``S`` bytes over ``n`` ranks moves ``2(n-1)/n * S`` per rank
    (the bus bandwidth convention of nccl-tests) in ``2(n-1)`` latency-bound hops; the
    probe's large and 4-byte all-reduces give one each. ``(None, None)`` without a probe.
    """
    n = result.get("link_probe_ranks", result.get("data_parallel_size", 1))
    if not result.get("link_probe_s") or n < 2:
        return None, None
    bus = 2 * (n - 1) / n * result["link_probe_bytes"] / result["link_probe_s"]
    return bus, result["link_small_s"] / (2 * (n - 1))


def add_scaling_efficiency(rows: list[BenchRow], reference: str = "single") -> None:
    """``throughput_N / (N * throughput_1)``; throughput_1 is ``reference`` at world size 1 and
    the row's precision when measured, else the same strategy and precision at world size 1
    (so a faster precision is not counted as scaling).

    An efficiency above :data:`SUPERLINEAR`, or against a ``noisy`` baseline, gets an
    ``efficiency_flag`` saying why it is not to be trusted.
    """
    ones = {(r.strategy, r.precision): r for r in rows if r.ok and r.world_size == 1}
    for row in rows:
        base = ones.get((reference, row.precision)) or ones.get((row.strategy, row.precision))
        if not (row.ok and base and base.samples_per_s):
            continue
        row.scaling_efficiency = row.samples_per_s / (row.world_size * base.samples_per_s)
        if base is row:
            continue
        baseline = f"baseline {base.label} x1"
        if base.cpu_percent is not None:
            baseline += f" (CPU {base.cpu_percent:.0f}%)"
        if row.scaling_efficiency > SUPERLINEAR:
            row.efficiency_flag = (f"above {SUPERLINEAR:.0%}: {baseline} likely measured slow; "
                                   "rerun with the machine otherwise idle")
        elif base.noisy:
            row.efficiency_flag = f"{baseline} noisy: its windows spread over {NOISY_SPREAD:.0%}"


def efficiency_text(row: BenchRow) -> str:
    """The table's efficiency cell: a percentage, marked ``(!)`` when flagged."""
    if row.scaling_efficiency is None:
        return "-"
    return _pct(row.scaling_efficiency) + (" (!)" if row.efficiency_flag else "")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


@dataclass
class BenchReport:
    """Every measured (or skipped) configuration plus the settings that produced them."""

    settings: dict[str, Any]
    rows: list[BenchRow] = field(default_factory=list)

    def row(self, label: str, world_size: int) -> BenchRow:
        """The row named ``label`` (``ddp``, ``ddp+bf16-mixed``) at ``world_size``."""
        for r in self.rows:
            if r.label == label and r.world_size == world_size:
                return r
        raise KeyError((label, world_size))

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: settings and every row with every field (and its ``label``)."""
        return {"settings": dict(self.settings),
                "rows": [{"label": r.label, **asdict(r)} for r in self.rows]}

    def format_table(self) -> str:
        """Aligned text: one line per strategy x world size; skipped ones with their reason."""
        head = ("strategy", "N", "samples/s", "spread", "s/epoch", "step", "exposed comm",
                "peak mem/rank", "params+grads+opt", "CPU %", "GPU %", "efficiency", "note")
        rows = [head]
        for r in self.rows:
            if not r.ok:
                rows.append((r.label, str(r.world_size), *["-"] * (len(head) - 3),
                             f"{r.status}: {r.reason}"))
                continue
            state = (r.param_bytes or 0) + (r.grad_bytes or 0) + (r.optimizer_bytes or 0)
            flags = [f for f in ("noisy" if r.noisy else "", r.efficiency_flag) if f]
            rows.append((
                r.label, str(r.world_size), f"{r.samples_per_s:,.1f}",
                f"{r.samples_per_s_min:,.0f}-{r.samples_per_s_max:,.0f}",
                f"{r.seconds_per_epoch:,.1f}", format_seconds(r.step_time_s),
                _pct(r.exposed_comm_share), format_bytes(r.peak_memory_bytes),
                format_bytes(state), f"{r.cpu_percent:.0f}", r.gpu_text(),
                efficiency_text(r), "; ".join([*flags, r.note] if r.note else flags)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        left = {0, len(head) - 1}
        lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def write_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def write_csv(self, path: str | Path) -> None:
        """One row per configuration (``label`` first); list fields are joined with ``;``."""
        names = ["label", *(f.name for f in fields(BenchRow))]
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=names)
            writer.writeheader()
            for r in self.rows:
                row = {"label": r.label, **asdict(r)}
                row["peak_memory_per_rank"] = ";".join(map(str, r.peak_memory_per_rank))
                writer.writerow({k: "" if v is None else v for k, v in row.items()})

    def plot(self, path: str | Path) -> None:
        """PNG: throughput (with min-max spread) and peak memory per rank, per strategy."""
        try:
            import matplotlib
        except ImportError:
            raise ValueError("the PNG plot needs matplotlib: pip install 'paratrain[plots]'") from None
        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt

        fig, (ax_speed, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
        for name in dict.fromkeys(r.label for r in self.rows):
            ok = sorted((r for r in self.rows if r.label == name and r.ok),
                        key=lambda r: r.world_size)
            if not ok:
                continue
            xs = [r.world_size for r in ok]
            ys = [r.samples_per_s for r in ok]
            err = [[y - r.samples_per_s_min for y, r in zip(ys, ok)],
                   [r.samples_per_s_max - y for y, r in zip(ys, ok)]]
            ax_speed.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=name)
            ax_mem.plot(xs, [r.peak_memory_bytes / 1e6 for r in ok], marker="o", label=name)
        ax_speed.set(title="throughput (median, min-max)", xlabel="world size",
                     ylabel="samples/s")
        ax_mem.set(title="peak memory per rank (above baseline)", xlabel="world size",
                   ylabel="MB")
        for ax in (ax_speed, ax_mem):
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
            ax.xaxis.get_major_locator().set_params(integer=True)
        fig.suptitle(self.settings.get("title", "paratrain bench"), fontsize=10)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
