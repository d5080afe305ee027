"""What ``paratrain plan`` shows: the report, its table and JSON, and the recommendation."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from paratrain.plan.costs import TP_TRAFFIC_UNKNOWN
from paratrain.plan.types import Hardware, ModelProfile, Prediction
from paratrain.strategies.table import strategy_names
from paratrain.units import format_bytes, format_seconds

#: Predictions closer than this (relative) are a tie; the simpler strategy is recommended.
TIE_MARGIN = 0.02
#: Simplest first: the tie-break order of the recommendation (the strategy table's order).
PREFERENCE: tuple[str, ...] = strategy_names()


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """All predictions plus the recommended strategy and a one-sentence reason."""

    profile: ModelProfile
    hardware: Hardware
    batch_size_per_device: int
    settings: dict[str, Any]
    predictions: list[Prediction] = field(default_factory=list)
    recommendation: str = ""
    reason: str = ""

    def prediction(self, strategy: str) -> Prediction:
        """The row for ``strategy`` (KeyError if it was not predicted)."""
        for p in self.predictions:
            if p.strategy == strategy:
                return p
        raise KeyError(strategy)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (only str, int, float, bool, None, lists and dicts)."""
        return {
            "profile": asdict(self.profile), "hardware": asdict(self.hardware),
            "batch_size_per_device": self.batch_size_per_device, "settings": dict(self.settings),
            "predictions": [asdict(p) for p in self.predictions],
            "recommendation": self.recommendation, "reason": self.reason,
        }

    def format_table(self) -> str:
        """An aligned plain-text table, one row per strategy."""
        head = ("strategy", "devices", "step", "samples/s", "efficiency", "exposed comm",
                "memory/device", "fits", "note")
        rows = [head]
        for p in self.predictions:
            if not p.modelled:
                rows.append((f"{p.strategy} (not modelled)", *["-"] * 7, p.note))
                continue
            fits = "?" if p.fits is None else ("yes" if p.fits else "NO")
            flag = "" if p.applicable else " (n/a)"
            times = (format_seconds(p.step_time), f"{p.samples_per_second:,.1f}",
                     f"{p.scaling_efficiency:.0%}", format_seconds(p.exposed_comm_time))
            if p.note == TP_TRAFFIC_UNKNOWN:  # traffic costed at 0 bytes: no time to show
                times = ("-",) * 4
            rows.append((p.strategy + flag, str(p.num_devices), *times,
                         format_bytes(p.memory_bytes), fits, p.note))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        # Text columns left-aligned, numbers right-aligned so digits line up.
        left = {0, 7, 8}
        lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def recommend(preds: list[Prediction], limit: float | None) -> tuple[str, str]:
    """``(strategy, one-sentence reason)``: the fastest applicable strategy that fits in
    ``limit`` bytes per device, near-ties going to the simplest (see ``docs/plan.md``).
    Predictions with ``modelled=False`` are never recommended."""
    usable = [p for p in preds if p.applicable and p.modelled]
    if not usable:
        return "", ("No requested strategy is both modelled and applicable to this model "
                    "and hardware.")
    rank = {name: i for i, name in enumerate(PREFERENCE)}
    if limit is not None and not any(p.fits for p in usable):
        best = min(usable, key=lambda p: (p.memory_bytes, rank[p.strategy]))
        return best.strategy, (
            f"No strategy fits in {format_bytes(limit)} per device; {best.strategy} needs the "
            f"least ({format_bytes(best.memory_bytes)}), so lower the batch size, enable "
            "activation checkpointing or add devices.")
    cands = [p for p in usable if limit is None or p.fits]
    top = max(cands, key=lambda p: p.samples_per_second)
    # The model is not accurate to 2%: among near-ties the simplest strategy wins.
    tied = [p for p in cands if p.samples_per_second >= top.samples_per_second * (1 - TIE_MARGIN)]
    best = min(tied, key=lambda p: rank[p.strategy])
    speed = f"{best.samples_per_second:,.1f} samples/s"
    if best is not top:
        speed += (f"; {top.strategy} is predicted {top.samples_per_second / best.samples_per_second - 1:.1%}"
                  f" faster, within the {TIE_MARGIN:.0%} margin, so the simpler one wins")
    if limit is None:
        return best.strategy, (f"{best.strategy} has the highest predicted throughput ({speed}); "
                               "memory was not checked because no device memory was given.")
    slower = [p.strategy for p in usable if not p.fits
              and p.samples_per_second > best.samples_per_second]
    extra = f", while faster {', '.join(slower)} would not fit" if slower else ""
    return best.strategy, (f"{best.strategy} is the fastest strategy that fits in "
                           f"{format_bytes(limit)} per device ({speed}){extra}.")
