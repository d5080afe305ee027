"""``paratrain plan --sequence N [--experts E --top-k K]``: the cp and ep rows and tables.

The costs are :mod:`paratrain.plan.context_experts`'; this module turns the command
line's profile (one sample = one sequence of ``--sequence`` tokens) into a
:class:`~paratrain.plan.context_experts.TransformerShape`, picks the degrees the
devices allow, and formats one row per degree plus the memory-per-rank tables.

Without a transformer to read, the shape is estimated: every one of the ``L`` layers
(``--layers``, else the profile's) holds an attention block of ``4 d^2`` parameters and
an MLP of ``8 d^2`` (hidden ``4 d``), or with ``--experts E`` an MoE layer of ``E`` such
MLPs; ``d`` is ``--width``, else solved from the parameter count
(``N = L d^2 (4 + 8 max(1, E))``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from paratrain.plan.context_experts import (
    ParallelStep,
    TransformerShape,
    context_memory,
    context_step,
    expert_memory,
    expert_step,
)
from paratrain.plan.types import Hardware, ModelProfile
from paratrain.units import format_bytes, format_seconds

__all__ = ["CONTEXT_DEGREES", "EXPERT_DEGREES", "EXPERT_SCALES", "SEQUENCE_SCALES",
           "ContextExpertsPlan", "cli_shape", "plan_context_experts"]

#: Degrees costed (those dividing the device count); 1 is the baseline row.
CONTEXT_DEGREES = (1, 2, 4)
EXPERT_DEGREES = (1, 2, 4)
#: Rows of the memory tables: multiples of ``--sequence`` and of ``--experts``.
SEQUENCE_SCALES = (1, 2, 4, 8)
EXPERT_SCALES = (1, 2, 4)
#: The runtime's ring and all-to-all wait for each transfer, and the cp/ep gradient
#: all-reduce is costed unhidden, as ``benchmarks/plan_context_experts.py`` validates.
OVERLAP = 0.0


def cli_shape(profile: ModelProfile, *, sequence: int, width: int | None = None,
              experts: int = 0, top_k: int = 1, layers: int | None = None) -> TransformerShape:
    """The shape the command line describes (see the module's docstring). ValueErrors
    start with the flag at fault."""
    n = profile.num_parameters
    layers = profile.num_layers if layers is None else layers
    if experts and top_k > experts:
        raise ValueError(f"--top-k: {top_k} must be <= --experts {experts}")
    if width is None:
        width = max(1, math.isqrt(n // (layers * (4 + 8 * max(1, experts)))))
    expert_params = layers * experts * 8 * width * width
    if expert_params >= n:
        raise ValueError(f"--experts: {experts} experts of width {width} in {layers} layers "
                         f"hold {expert_params:,} parameters, not fewer than the model's {n:,}; "
                         "lower --width or --experts")
    per_token = 2 * (n - expert_params) + (2 * top_k * expert_params / experts if experts else 0)
    attention = 2 * sequence * width * layers
    return TransformerShape(sequence=sequence, width=width, attention_layers=layers,
                            moe_layers=layers if experts else 0, experts=experts,
                            top_k=top_k if experts else 1, expert_parameters=expert_params,
                            row_bytes=profile.param_bytes,
                            attention_fraction=attention / (attention + per_token))


@dataclass(frozen=True, kw_only=True)
class ContextExpertsPlan:
    """The cp rows, the ep rows (empty for a dense model) and the memory tables."""

    profile: ModelProfile
    shape: TransformerShape
    hardware: Hardware
    batch: int
    context: list[ParallelStep]
    experts: list[ParallelStep]
    sequences: list[int]
    expert_counts: list[int]

    def samples_per_second(self, kind: str, step: ParallelStep) -> float:
        """Sequences per second over all devices: cp groups of ``degree`` ranks share a
        sequence, ep ranks each read ``batch``."""
        replicas = self.hardware.world_size // (step.degree if kind == "cp" else 1)
        return self.batch * replicas / step.step_time

    def _rows(self) -> list[tuple[str, ParallelStep]]:
        return [("cp", s) for s in self.context] + [("ep", s) for s in self.experts]

    def _fits(self, step: ParallelStep) -> bool | None:
        limit = self.hardware.device_memory_bytes
        return None if limit is None else step.memory.total <= limit

    def format(self) -> str:
        """The rows, then activations per rank against sequence length and, with
        experts, model state per rank against the expert count."""
        sh, hw = self.shape, self.hardware
        moe = (f", {sh.experts} experts top-{sh.top_k} in {sh.moe_layers} MoE layers"
               if sh.experts else ", dense")
        lines = [f"context / expert parallel: sequence {sh.sequence} tokens, width {sh.width}, "
                 f"{sh.attention_layers} attention layers{moe}; {hw.num_nodes} node(s) x "
                 f"{hw.num_devices_per_node} devices",
                 "(ring and all-to-all wait for each transfer, gradient all-reduce not "
                 "overlapped; cp=1 and ep=1: plain data parallel costed the same way)"]
        head = ("layout", "step", "samples/s", "ring/all-to-all", "exposed comm", "sent/rank",
                "activations/rank", "memory/rank", "fits")
        table = [head]
        for kind, s in self._rows():
            fits = self._fits(s)
            table.append((f"{kind}={s.degree}", format_seconds(s.step_time),
                          f"{self.samples_per_second(kind, s):,.1f}",
                          format_seconds(s.comm - s.sync), format_seconds(s.exposed),
                          format_bytes(s.traffic), format_bytes(s.memory.activation_memory),
                          format_bytes(s.memory.total),
                          "?" if fits is None else ("yes" if fits else "NO")))
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in table]
        for title, corner, _, cells in self._tables():
            grid = [(corner, *next(iter(cells.values())).keys())]
            grid += [(row, *map(format_bytes, by_degree.values()))
                     for row, by_degree in cells.items()]
            widths = [max(len(r[i]) for r in grid) for i in range(len(grid[0]))]
            lines += ["", title] + ["  ".join(c.rjust(w) for c, w in zip(r, widths))
                                    for r in grid]
        return "\n".join(lines)

    def _tables(self) -> list[tuple[str, str, str, dict[str, dict[str, float]]]]:
        """(title, corner, JSON key, {row: {column: bytes}}): activations per rank against sequence
        length, and with experts the model state per rank against the expert count."""
        prof, sh = self.profile, self.shape

        def state(e: int, ep: int) -> float:
            m = expert_memory(prof, sh, ep=ep, batch=1, experts=e)
            return m.total - m.activation_memory

        tables = [(f"activations per rank (batch {self.batch}) vs sequence length:", "sequence",
                   "activations_vs_sequence",
                   {str(seq): {f"cp={s.degree}": context_memory(
                       prof, sh, cp=s.degree, batch=self.batch, sequence=seq).activation_memory
                       for s in self.context} for seq in self.sequences})]
        if self.experts:
            tables.append(("parameters + gradients + optimizer state per rank vs experts:",
                           "experts", "state_vs_experts", {str(e): {f"ep={s.degree}": state(e, s.degree)
                                                for s in self.experts}
                                       for e in self.expert_counts}))
        return tables

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the shape, one dict per row, and the tables' cells in bytes
        (``activations_vs_sequence``: {length: {"cp=C": bytes}}, ``state_vs_experts``:
        {count: {"ep=E": bytes}})."""
        rows = []
        for kind, s in self._rows():
            rows.append({
                "parallel": kind, "degree": s.degree, "step_time": s.step_time,
                "samples_per_second": self.samples_per_second(kind, s), "compute": s.compute,
                "comm": s.comm, "sync": s.sync, "exposed_comm": s.exposed,
                "optimizer": s.optimizer, "bytes_sent": s.traffic,
                "activation_memory": s.memory.activation_memory, "memory": s.memory.total,
                "fits": self._fits(s)})
        data: dict[str, Any] = {"shape": vars(self.shape).copy(), "batch": self.batch,
                                "rows": rows}
        for _, _, key, cells in self._tables():
            data[key] = cells
        return data


def plan_context_experts(profile: ModelProfile, hardware: Hardware, shape: TransformerShape,
                         *, batch: int) -> ContextExpertsPlan:
    """Cost cp (and ep for an MoE shape) at the degrees dividing the device count.
    ValueErrors start with the flag at fault."""
    world = hardware.world_size
    cps = [c for c in CONTEXT_DEGREES if world % c == 0]
    for cp in cps:
        if shape.sequence % (2 * cp):
            raise ValueError(f"--sequence: {shape.sequence} is not a multiple of 2 * cp = "
                             f"{2 * cp} (cp={cp} is costed on {world} devices)")
    eps = [e for e in EXPERT_DEGREES if world % e == 0] if shape.experts else []
    for ep in eps:
        if shape.experts % ep:
            raise ValueError(f"--experts: {shape.experts} is not a multiple of ep={ep} "
                             f"(ep={ep} is costed on {world} devices)")
    context = [context_step(profile, hardware, shape, cp=c, batch=batch, overlap=OVERLAP)
               for c in cps]
    experts = [expert_step(profile, hardware, shape, ep=e, batch=batch, overlap=OVERLAP)
               for e in eps]
    return ContextExpertsPlan(
        profile=profile, shape=shape, hardware=hardware, batch=batch, context=context, experts=experts,
        sequences=[shape.sequence * k for k in SEQUENCE_SCALES],
        expert_counts=[shape.experts * k for k in EXPERT_SCALES] if shape.experts else [])
