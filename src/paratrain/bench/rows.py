"""Which configurations ``paratrain bench`` measures: rows (a strategy at a precision), the
device and the world sizes, each resolved from the request and from what this machine has.

A row is named ``STRATEGY`` (float32) or ``STRATEGY+PRECISION``, e.g. ``ddp+bf16-mixed``,
or is a layout of degrees (``cp=2``, ``dp_shard=2,cp=2+bf16-mixed``; see
:mod:`paratrain.bench.layouts`), labelled by its canonical degree string.
On a machine with CUDA the default rows are the seeds' comparison table
(:data:`GPU_DEFAULT_ROWS`, the strategy table's ``gpu_bench_precisions``); on CPU they are
every registered strategy at float32, in the strategy table's order.

Example::

    >>> [r.label for r in resolve_rows(["ddp", "fsdp+bf16-mixed"], precisions=["32", "bf16-mixed"],
    ...                                accelerator="cpu")]
    ['ddp', 'ddp+bf16-mixed', 'fsdp+bf16-mixed']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from paratrain.bench.layouts import is_layout, layout_label
from paratrain.config import PRECISIONS
from paratrain.strategies.table import STRATEGY_TABLE, strategy_names

#: The reference of scaling efficiency; it is one process by definition.
REFERENCE = "single"

#: What ``paratrain bench`` compares on a GPU machine unless told otherwise.
GPU_DEFAULT_ROWS: tuple[str, ...] = tuple(
    entry.name if precision == "32" else f"{entry.name}+{precision}"
    for entry in STRATEGY_TABLE for precision in entry.gpu_bench_precisions)

ACCELERATORS = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class RowSpec:
    """One row of the table: a registered strategy (or a layout's degree string, e.g.
    ``dp_shard=2,cp=2``) at one of ``Run``'s precisions."""

    strategy: str
    precision: str = "32"

    @property
    def label(self) -> str:
        """``ddp`` for float32, ``ddp+bf16-mixed`` otherwise."""
        return self.strategy if self.precision == "32" else f"{self.strategy}+{self.precision}"

    @property
    def layout(self) -> bool:
        """Whether the row is a layout of degrees, run as ``Run(parallel=...)``."""
        return is_layout(self.strategy)


def resolve_accelerator(requested: str) -> str:
    """``cpu`` or ``cuda``: ``auto`` picks CUDA when a device is visible (as ``Run`` does)."""
    import torch

    if requested not in ACCELERATORS:
        raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {requested!r}")
    if requested == "cuda" and not torch.cuda.is_available():
        raise ValueError("accelerator 'cuda' but no CUDA device is visible; use --accelerator cpu")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def default_world_sizes(accelerator: str) -> tuple[int, ...]:
    """CPU: 1 and 2 processes. CUDA: one process, and one per visible GPU when there are several."""
    if accelerator != "cuda":
        return (1, 2)
    import torch

    return tuple(sorted({1, max(1, torch.cuda.device_count())}))


def parse_precisions(items: Sequence[str]) -> tuple[str, ...]:
    """Checked, deduplicated precisions (ValueError listing the choices)."""
    values = tuple(dict.fromkeys(p.strip() for p in items if p.strip()))
    unknown = [p for p in values if p not in PRECISIONS]
    if not values or unknown:
        raise ValueError(f"precisions: unknown {', '.join(unknown) or '(none given)'}; "
                         f"choose from {', '.join(PRECISIONS)}")
    return values


def resolve_rows(requested: Sequence[str] | None, *, precisions: Sequence[str] = ("32",),
                 accelerator: str = "cpu") -> list[RowSpec]:
    """Rows to measure, the reference first, otherwise in the requested (or table) order.

    ``requested`` items are ``STRATEGY`` (measured at every one of ``precisions``) or
    ``STRATEGY+PRECISION`` (at that precision only); a ``STRATEGY`` with ``=`` is a layout
    of degrees (``cp=2``), labelled canonically. None means :data:`GPU_DEFAULT_ROWS` on
    CUDA, else every registered strategy. Unknown names are a ValueError listing the choices.
    """
    known = strategy_names()
    precisions = parse_precisions(precisions)
    if requested is None:
        requested = GPU_DEFAULT_ROWS if accelerator == "cuda" else known
    rows: list[RowSpec] = []
    for item in requested:
        name, plus, precision = item.partition("+")
        if plus:
            parse_precisions([precision])
        if is_layout(name):
            name = layout_label(name)
        rows += [RowSpec(name, p) for p in ((precision,) if plus else precisions)]
    unknown = list(dict.fromkeys(r.strategy for r in rows
                                 if r.strategy not in known and not r.layout))
    if unknown:
        raise ValueError(f"strategies: unknown {', '.join(unknown)}; registered: {', '.join(known)}")
    # The reference first, so scaling efficiency has its baseline early in the table.
    return sorted(dict.fromkeys(rows), key=lambda r: r.strategy != REFERENCE)


def gpu_shortfall(processes: int, accelerator: str) -> str:
    """Why ``processes`` cannot each have a GPU of their own here, or ""."""
    if accelerator != "cuda":
        return ""
    import torch

    visible = torch.cuda.device_count()
    if processes > visible:
        return f"needs {processes} GPUs (one per process), {visible} visible"
    return ""
