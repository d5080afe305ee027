"""Scaling tables for ``paratrain plan --nodes 1,2,4,8``: one plan per cluster size.

Each node count is planned with the same model, links and per-device batch (weak
scaling: the global batch grows with the devices); the table puts throughput and
scaling efficiency of every strategy side by side so the knee of each curve shows.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from paratrain.plan.model import Hardware, ModelProfile, PlanReport, plan


def parse_node_counts(text: str) -> tuple[int, ...]:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)``: positive, distinct, kept in the given order."""
    parts = [p.strip() for p in str(text).split(",")]
    try:
        counts = tuple(int(p) for p in parts)
    except ValueError:
        raise ValueError(f"expected positive integers such as 2 or 1,2,4,8, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"node counts must be positive integers, got {text!r}")
    if len(set(counts)) != len(counts):
        raise ValueError(f"node counts must be distinct, got {text!r}")
    return counts


def plan_scaling(profile: ModelProfile, hardware: Hardware, node_counts: tuple[int, ...],
                 **plan_kwargs: Any) -> list[PlanReport]:
    """One :func:`~paratrain.plan.model.plan` per node count; ``hardware.num_nodes`` is replaced.

    Example::

        reports = plan_scaling(profile, hw, (1, 2, 4), batch_size_per_device=32)
        print(format_scaling(reports))
    """
    if not node_counts:
        raise ValueError("node_counts must name at least one node count")
    return [plan(profile, replace(hardware, num_nodes=k), **plan_kwargs) for k in node_counts]


def format_scaling(reports: list[PlanReport]) -> str:
    """Plain-text table: a row per node count, ``samples/s (efficiency)`` per strategy.

    Strategies that do not apply (pipeline with too few layers) show ``n/a``; those that
    do not fit the device memory are marked ``!``; those without a cost model show ``-``
    and carry ``*``.
    """
    names = [p.strategy for p in reports[0].predictions]
    head = ["nodes", "devices", *[_header(reports[0], n) for n in names], "recommended"]
    rows = [head]
    for report in reports:
        cells = [str(report.hardware.num_nodes), str(report.hardware.world_size)]
        for name in names:
            p = report.prediction(name)
            if not p.modelled:
                cells.append("-")
                continue
            if not p.applicable:
                cells.append("n/a")
                continue
            mark = "!" if p.fits is False else ""
            cells.append(f"{p.samples_per_second:,.0f} ({p.scaling_efficiency:.0%}){mark}")
        cells.append(report.recommendation or "-")
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if 0 < i < len(head) - 1 else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
             for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    legend = "samples/s (scaling efficiency); ! does not fit the device memory"
    if any(not p.modelled for p in reports[0].predictions):
        legend += "; * not modelled (never recommended)"
    return "\n".join([*lines, legend])


def _header(report: PlanReport, name: str) -> str:
    return name if report.prediction(name).modelled else name + "*"


def scaling_dict(reports: list[PlanReport]) -> dict[str, Any]:
    """JSON-ready: the node counts and each count's full report."""
    return {"nodes": [r.hardware.num_nodes for r in reports],
            "reports": [r.to_dict() for r in reports]}
