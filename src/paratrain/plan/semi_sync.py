"""Semi-synchronous rows for ``paratrain plan``: LocalSGD and DiLoCo over the nodes.

``Parallel(dp_replicate=R, dp_shard=n, semi_sync=LocalSGD(every=H) | DiLoCo(...))`` with
one replica group per node: each group is FSDP over its node's ``n`` devices (costed as
``hybrid``'s layout ``dp_shard=n`` on one node, the replicate axis left out), and every
``H / k`` steps a rank all-reduces ``1/k`` of its local shard over the ``R`` groups on the
inter-node link (``k`` fragments; 1 but for streaming DiLoCo). Per step, on average::

    bytes    = N / n * e / H              e: param bytes (LocalSGD, DiLoCo), 2 (bf16), 1 (int8)
    exposed  = sync                       one all-reduce of N / n * e / k bytes over R
                                          (int8: an all-gather of R such messages)
             | max(0, sync - overlap * inner compute)     DiLoCo(overlap=True)
    step     = inner step + exposed / (H / k)
    memory   = inner memory + a flat copy of the sent 1/k (LocalSGD: the whole shard)
               (DiLoCo: + snapshot + outer momentum, 2 copies of the shard;
               int8: + the R messages gathered)

A throughput plan, not a convergence guarantee: the rows say nothing of the loss
reached per token. Written out in ``docs/plan.md`` ("Semi-synchronous rows").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from paratrain.distributed.mesh import ParallelDegrees
from paratrain.parallel.options import DiLoCo, LocalSGD, changed_fields
from paratrain.plan.comm import allgather_bytes, allgather_time, allreduce_bytes, allreduce_time
from paratrain.plan.layouts import group_hardware
from paratrain.plan.model import predict
from paratrain.plan.report import TIE_MARGIN, PlanReport
from paratrain.plan.types import Hardware, ModelProfile, Prediction, check_positive_int
from paratrain.units import format_bytes, format_seconds

__all__ = ["CAVEAT", "EVERY", "MARGIN", "SLOW_SHARE", "SemiSyncPlan", "SemiSyncRow",
           "candidate_modes", "exposed_share", "link_is_slow", "mode_label", "plan_semi_sync", "semi_sync_row"]

EVERY = (10, 50, 100)
"""The ``H`` costed when nothing forces one (``--semi-sync H``)."""
SLOW_SHARE = 0.10
"""The rows are added when the same layout run synchronously (``hybrid``'s default HSDP,
replicas across nodes) spends at least this share of its step in exposed communication:
the inter-node link is slow for this model."""
MARGIN = 0.20
"""A semi-synchronous row is recommended only this much faster than the synchronous one:
it pays for the tokens it may need beyond DDP's and for the model's own error."""
CAVEAT = ("a throughput plan, not a convergence guarantee: semi-synchronous groups may need "
          "more tokens than DDP for the same loss (DiLoCo's papers: within a few % at "
          "H = 50-500); compare the loss at equal tokens before a long run")

Mode = LocalSGD | DiLoCo


def mode_label(mode: Mode) -> str:
    """``DiLoCo(every=50, fragments=10, overlap=True, comm_dtype='bf16')``: the fields set."""
    fields = ", ".join(f"{k}={v!r}" for k, v in changed_fields(mode).items())
    return f"{type(mode).__name__}({fields})"


def candidate_modes(every: tuple[int, ...] = EVERY, *, num_layers: int) -> list[Mode]:
    """Per ``H``: LocalSGD, DiLoCo, and streaming DiLoCo (``k`` fragments, the largest
    divisor of ``H`` up to ``num_layers`` blocks, overlapped, bf16) when ``H >= 2``."""
    modes: list[Mode] = []
    for h in every:
        check_positive_int("every", h)
        modes += [LocalSGD(every=h), DiLoCo(every=h)]
        if h >= 2:
            k = max(d for d in range(1, min(h, num_layers) + 1) if h % d == 0)
            modes.append(DiLoCo(every=h, fragments=k, overlap=True, comm_dtype="bf16"))
    return modes


@dataclass(frozen=True, kw_only=True)
class SemiSyncRow:
    """One semi-synchronous layout's average step (seconds, bytes per device)."""

    mode: Mode
    replicate: int
    shard: int
    inner: Prediction
    """One inner step of a group: ``hybrid`` with ``dp_shard=shard`` on one node."""
    payload: float
    """Bytes a rank all-reduces over the replicate axis at one sync (int8: its message,
    all-gathered with the other groups')."""
    sync_every: int
    """Steps between two syncs of this rank (``H / k``)."""
    sync_time: float
    """One sync's all-reduce."""
    exposed_per_sync: float
    traffic: float
    """Bytes a rank sends per step, averaged over the syncs."""
    outer_memory: float
    """Memory beyond the inner layout's: the flat copy sent, DiLoCo's snapshot and momentum."""
    fits: bool | None

    @property
    def label(self) -> str:
        """What to pass to ``Run``."""
        return (f"Parallel(dp_replicate={self.replicate}, dp_shard={self.shard}, "
                f"semi_sync={mode_label(self.mode)})")

    @property
    def bytes_per_step(self) -> float:
        """Payload per step: the local shard's bytes (bf16: 2 per parameter, int8: 1) / H."""
        return self.payload / self.sync_every

    @property
    def exposed_per_step(self) -> float:
        return self.exposed_per_sync / self.sync_every

    @property
    def step_time(self) -> float:
        return self.inner.step_time + self.exposed_per_step

    @property
    def samples_per_second(self) -> float:
        return self.replicate * self.inner.global_batch_size / self.step_time

    @property
    def memory_bytes(self) -> float:
        return self.inner.memory_bytes + self.outer_memory


def semi_sync_row(profile: ModelProfile, hardware: Hardware, mode: Mode, *,
                  batch_size_per_device: int, overlap: float = 1.0) -> SemiSyncRow:
    """``mode`` with one replica group per node of ``hardware`` (see the module's docstring)."""
    if not isinstance(mode, (LocalSGD, DiLoCo)):
        raise ValueError(f"mode must be a LocalSGD or a DiLoCo, got {type(mode).__name__}")
    r, n = hardware.num_nodes, hardware.num_devices_per_node
    if r < 2:
        raise ValueError(f"semi-synchronous rows need 2+ nodes (one replica group per node), got {r}")
    inner = predict("hybrid", profile, replace(hardware, num_nodes=1),
                    batch_size_per_device=batch_size_per_device, overlap=overlap,
                    layout=ParallelDegrees(shard_degree=n))
    k = getattr(mode, "fragments", 1)
    diloco = isinstance(mode, DiLoCo)
    comm = mode.comm_dtype if diloco else None
    per_param = {"bf16": 2, "int8": 1}.get(comm, profile.param_bytes)
    shard = profile.num_parameters / n  # parameters of this rank's local shard
    payload = shard * per_param / k  # int8: + a 4-byte scale per bucket, left out
    replicas = group_hardware(hardware, size=r, stride=n)
    gathered = r * payload if comm == "int8" else 0.0  # int8 cannot be summed: gathered
    sync = allgather_time(gathered, replicas) if gathered else allreduce_time(payload, replicas)
    sent = allgather_bytes(gathered, replicas) if gathered else allreduce_bytes(payload, replicas)
    hidden = overlap * inner.compute_time if diloco and mode.overlap else 0.0
    outer = payload + gathered + (2 * shard * profile.param_bytes if diloco else 0.0)
    limit = hardware.device_memory_bytes
    row = SemiSyncRow(mode=mode, replicate=r, shard=n, inner=inner, payload=payload,
                      sync_every=mode.every // k, sync_time=sync,
                      exposed_per_sync=max(0.0, sync - hidden),
                      traffic=sent * k / mode.every,
                      outer_memory=outer, fits=None)
    return replace(row, fits=None if limit is None else row.memory_bytes <= limit)


def exposed_share(report: PlanReport) -> float:
    """The share of its step that HSDP over ``report``'s nodes (FSDP in a node, gradients
    all-reduced across nodes every step: the rows' layout, synchronous) spends in
    exposed communication."""
    hsdp = predict("hybrid", report.profile, report.hardware,
                   batch_size_per_device=report.batch_size_per_device,
                   overlap=report.settings.get("overlap", 1.0))
    return hsdp.exposed_comm_time / hsdp.step_time


def link_is_slow(report: PlanReport) -> bool:
    """Several nodes, and :func:`exposed_share` at least :data:`SLOW_SHARE`."""
    return report.hardware.num_nodes >= 2 and exposed_share(report) >= SLOW_SHARE


@dataclass(frozen=True, kw_only=True)
class SemiSyncPlan:
    """The rows, the synchronous row they are compared with, and the verdict."""

    rows: list[SemiSyncRow]
    baseline: Prediction | None
    recommended: SemiSyncRow | None
    reason: str
    why: str = ""
    """Why the rows are shown (the slow link, or ``--semi-sync``), for the header."""

    def format(self) -> str:
        """A header, one line per row, and the recommendation with its caveat."""
        first = self.rows[0]
        base = self.baseline
        lines = [f"semi-synchronous replicas: {first.replicate} groups (one per node) x "
                 f"dp_shard={first.shard}; a group's inner step is hybrid dp_shard="
                 f"{first.shard} on one node ({format_seconds(first.inner.step_time)})"
                 + (f"; {self.why}" if self.why else "")]
        vs = f"vs {base.strategy}" if base else "vs sync"
        head = ("semi_sync", "sync every", "payload/sync", "comm/sync", "exposed/step", "step",
                "samples/s", vs, "memory/device", "fits")
        table = [head]
        for row in self.rows:
            ratio = f"{row.samples_per_second / base.samples_per_second:.2f}x" if base else "-"
            table.append((mode_label(row.mode), str(row.sync_every), format_bytes(row.payload),
                          format_seconds(row.sync_time), format_seconds(row.exposed_per_step),
                          format_seconds(row.step_time), f"{row.samples_per_second:,.1f}", ratio,
                          format_bytes(row.memory_bytes),
                          "?" if row.fits is None else ("yes" if row.fits else "NO")))
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                  for r in table]
        lines.append(f"semi-sync recommendation: "
                     f"{self.recommended.label if self.recommended else 'none'}")
        lines.append(f"reason: {self.reason}")
        if self.recommended:
            lines.append(f"caveat: {CAVEAT}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: one dict per row (seconds, bytes), the baseline's name, the verdict."""
        rows = [{"semi_sync": mode_label(r.mode), "layout": r.label, "every": r.mode.every,
                 "fragments": r.mode.every // r.sync_every, "sync_every": r.sync_every,
                 "payload_bytes": r.payload, "bytes_per_step": r.bytes_per_step,
                 "bytes_sent_per_step": r.traffic, "sync_time": r.sync_time,
                 "exposed_per_sync": r.exposed_per_sync, "exposed_per_step": r.exposed_per_step,
                 "inner_step_time": r.inner.step_time, "step_time": r.step_time,
                 "samples_per_second": r.samples_per_second, "outer_memory": r.outer_memory,
                 "memory": r.memory_bytes, "fits": r.fits} for r in self.rows]
        return {"rows": rows, "baseline": self.baseline.strategy if self.baseline else None,
                "recommendation": self.recommended.label if self.recommended else "",
                "reason": self.reason, "why": self.why, "caveat": CAVEAT}


def plan_semi_sync(report: PlanReport, *, every: tuple[int, ...] = EVERY,
                   why: str = "") -> SemiSyncPlan:
    """Cost :func:`candidate_modes` on ``report``'s cluster and batch and compare them with
    its recommendation: the fastest row that fits (near-ties to the smaller ``H``, then
    the simpler mode) is recommended when :data:`MARGIN` faster, or when the synchronous
    recommendation does not fit."""
    pr, hw, b = report.profile, report.hardware, report.batch_size_per_device
    overlap = report.settings.get("overlap", 1.0)
    rows = [semi_sync_row(pr, hw, m, batch_size_per_device=b, overlap=overlap)
            for m in candidate_modes(every, num_layers=pr.num_layers)]
    rows.sort(key=lambda r: r.mode.every)  # stable: LocalSGD, DiLoCo, streaming per H
    base = report.prediction(report.recommendation) if report.recommendation else None
    fitting = [r for r in rows if r.fits is not False]
    if not fitting:
        return SemiSyncPlan(rows=rows, baseline=base, why=why, recommended=None, reason=(
            "no semi-synchronous row fits the device memory (each adds the outer state to "
            "the inner layout's)."))
    top = max(r.samples_per_second for r in fitting)
    best = next(r for r in fitting if r.samples_per_second >= top * (1 - TIE_MARGIN))
    speed = f"{best.samples_per_second:,.1f} samples/s"
    if base is None or base.fits is False:
        what = "no synchronous strategy" if base is None else f"{base.strategy} does not fit"
        return SemiSyncPlan(rows=rows, baseline=base, why=why, recommended=best,
                            reason=f"{what}; {mode_label(best.mode)} is the fastest "
                            f"semi-synchronous row that fits ({speed}).")
    gain = best.samples_per_second / base.samples_per_second
    sync = f"{base.strategy} ({base.samples_per_second:,.1f} samples/s)"
    if gain < 1 + MARGIN:
        return SemiSyncPlan(rows=rows, baseline=base, why=why, recommended=None, reason=(
            f"stay synchronous: the fastest semi-synchronous row, {mode_label(best.mode)} "
            f"({speed}), is {gain:.2f}x {sync}, under the {1 + MARGIN:.2f}x it must reach."))
    return SemiSyncPlan(rows=rows, baseline=base, why=why, recommended=best, reason=(
        f"{mode_label(best.mode)} is predicted {gain:.2f}x the throughput of {sync}: "
        f"{speed}, {format_bytes(best.bytes_per_step)} per step over the replicate axis."))
