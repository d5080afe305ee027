"""``paratrain verify``: does the distributed run compute what the single-process run computes?

It trains a few probe steps of a setup (the demo by default) under several
factorizations of the same global batch (``world_size x micro_batch x
accumulate``), compares every step's gradients and the final parameters with
the 1-process, no-accumulation reference, flags those beyond tolerance and
names the likely cause: BatchNorm statistics per rank or micro-batch, a loss
averaged per micro-batch instead of over the global batch, a sampler that is
not seeded identically on every rank, or dropout drawing per-rank masks.

Example:
    >>> from paratrain.verify.runner import ProbeSetup, verify           # doctest: +SKIP
    >>> report = verify(ProbeSetup(model_fn=my_model, data_fn=my_data))  # doctest: +SKIP
    >>> print(report.format()); report.ok                          # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from paratrain.distributed.spawn import spawn
from paratrain.verify.probe import (
    Factorization,
    ProbeSetup,
    model_traits,
    probe_worker,
    resolve_accelerator,
    run_probe,
)

DEFAULT_FACTORIZATIONS = ("1x8x1", "2x4x1", "2x2x2", "1x2x4")
# float8: e5m2 gradients carry 2 mantissa bits (a half-ulp of 12.5%), scaled per tensor.
DEFAULT_TOLERANCE = {"32": 1e-4, "bf16-mixed": 5e-2, "16-mixed": 2e-2, "bf16-true": 1e-1,
                     "float8": 2.5e-1}

CAUSES = {
    "sampler": "the ranks' micro-batches are not the reference's global batch: the sampler is "
               "not seeded identically on every rank or not reseeded each epoch (use run.loader, "
               "or a DistributedSampler with the same seed and set_epoch(epoch))",
    "batchnorm": "BatchNorm normalises with the statistics of each rank's micro-batch (use "
                 "SyncBatchNorm, GroupNorm or LayerNorm; under accumulation only a norm "
                 "without batch statistics is exact)",
    "dropout": "dropout draws different masks per rank and micro-batch (expected and harmless "
               "for training; rerun with --no-dropout to check the rest)",
    "loss": "the loss is averaged per micro-batch instead of over the global batch (backward the "
            "summed loss with run.backward(loss_sum, count=...) - see paratrain.losses)",
}


@dataclass
class FactorizationResult:
    """How one factorization compares with the reference."""

    factorization: Factorization
    grad_rel_diff: float
    param_rel_diff: float
    data_matches: bool
    flagged: bool
    causes: list[str] = field(default_factory=list)
    reference: bool = False


@dataclass
class VerifyReport:
    """All factorizations' results; ``ok`` when none is flagged."""

    results: list[FactorizationResult]
    tolerance: float
    num_steps: int
    accelerator: str = "cpu"
    """Where the probes ran: ``cpu`` or ``cuda``."""

    @property
    def ok(self) -> bool:
        return not any(r.flagged for r in self.results)

    def format(self) -> str:
        """A table: max relative differences per factorization, flags and likely causes."""
        global_batch = self.results[0].factorization.global_batch
        lines = [f"verify: {self.num_steps} probe steps, global batch {global_batch}, "
                 f"tolerance {self.tolerance:.0e} (max relative difference vs the reference), "
                 f"on {self.accelerator}",
                 f"{'factorization':<14}{'world':>6}{'micro':>6}{'accum':>6}"
                 f"{'grad diff':>12}{'param diff':>12}  result"]
        for r in self.results:
            f = r.factorization
            if r.reference:
                diffs, verdict = f"{'reference':>12}{'':>12}", "reference"
            else:
                diffs = f"{r.grad_rel_diff:>12.1e}{r.param_rel_diff:>12.1e}"
                verdict = "FLAGGED" if r.flagged else "ok"
            lines.append(f"{f.label:<14}{f.world_size:>6}{f.micro_batch:>6}{f.accumulate:>6}"
                         f"{diffs}  {verdict}")
            lines += [f"{'':<14}likely cause: {CAUSES[c]}" for c in r.causes]
        lines.append("all factorizations match the reference" if self.ok else
                     "some factorizations differ from the reference: see the likely causes")
        return "\n".join(lines)


def _rel_diff(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """Max over tensors of max|got - ref| / max|ref|."""
    if len(got) != len(ref):
        return float("inf")
    worst = 0.0
    for a, b in zip(got, ref):
        a, b = a.double(), b.double()
        scale = max(b.abs().max().item(), 1e-12)
        worst = max(worst, (a - b).abs().max().item() / scale)
    return worst if worst == worst else float("inf")  # nan counts as a mismatch


def _whole_model(ranks: list[dict[str, Any]], names: list[str]) -> dict[str, Any] | None:
    """Gradients per step and final parameters in the order of ``names``, each taken from
    the first rank that holds it (pipeline stages hold different parameters, data-parallel
    peers the same ones, gathered whole); None when the names or step counts differ."""
    where: dict[str, tuple[int, int]] = {}
    for rank, result in enumerate(ranks):
        for index, name in enumerate(result["names"]):
            where.setdefault(name, (rank, index))
    steps = {len(r["grads"]) for r in ranks}
    if sorted(where) != sorted(names) or len(steps) != 1:
        return None
    places = [where[name] for name in names]
    return {"grads": [[ranks[rank]["grads"][step][index] for rank, index in places]
                      for step in range(steps.pop())],
            "params": [ranks[rank]["params"][index] for rank, index in places]}


def _compare(ranks: list[dict[str, Any]], reference: dict[str, Any]) -> tuple[float, float, bool]:
    main = _whole_model(ranks, reference["names"])
    if main is None or len(main["grads"]) != len(reference["grads"]):
        grad = param = float("inf")
    else:
        grad = max((_rel_diff(g, r) for g, r in zip(main["grads"], reference["grads"])),
                   default=0.0)
        param = _rel_diff(main["params"], reference["params"])
    # Ranks that read the same batch (one data-parallel rank) count their samples once.
    readers = list({r["data_rank"]: r for r in ranks}.values())
    data = all(reference["samples"].keys() == r["samples"].keys() for r in readers)
    for step, expected in reference["samples"].items():
        if not data:
            break
        merged = torch.cat([r["samples"].get(step, torch.zeros(0)) for r in readers])
        merged, expected = merged.sort().values, expected.sort().values
        scale = max(expected.abs().max().item() if expected.numel() else 1.0, 1.0)
        data = merged.shape == expected.shape and bool(
            ((merged - expected).abs() <= 1e-9 * scale).all())
    return grad, param, data


@contextlib.contextmanager
def caller_rng_kept() -> Iterator[None]:
    """Probes seed the global RNGs; the caller's streams continue as if nothing ran."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


def _run_all(setup: ProbeSetup, jobs: list[tuple[Factorization, frozenset[str]]]) -> dict:
    """Results by (factorization, variant): 1-process probes here, others in one spawn per size."""
    results: dict[tuple[Factorization, frozenset[str]], list[dict[str, Any]]] = {}
    for world_size in sorted({f.world_size for f, _ in jobs}):
        group = [job for job in jobs if job[0].world_size == world_size]
        if world_size == 1:
            for f, variant in group:
                results[(f, variant)] = [run_probe(setup, f, variant, environ={})]
            continue
        by_rank = spawn(probe_worker, world_size, setup, group, timeout=setup.timeout_s * len(group))
        for index, job in enumerate(group):
            results[job] = [rank_results[index] for rank_results in by_rank]
    return results


def parse_factorizations(items: Sequence[str | Factorization]) -> list[Factorization]:
    """Parse and check: one global batch; the 1-process reference ``1xGx1`` is added first."""
    factorizations = [f if isinstance(f, Factorization) else Factorization.parse(f) for f in items]
    if not factorizations:
        raise ValueError("factorizations must name at least one WORLDxMICROxACCUM")
    sizes = sorted({f.global_batch for f in factorizations})
    if len(sizes) > 1:
        raise ValueError(f"factorizations must share one global batch, got sizes {sizes}: "
                         "world x micro x accumulate must be equal for all")
    reference = Factorization(1, sizes[0], 1)
    rest = [f for f in dict.fromkeys(factorizations) if f != reference]
    return [reference, *rest]


def verify(setup: ProbeSetup | None = None, *,
           factorizations: Sequence[str | Factorization] = DEFAULT_FACTORIZATIONS,
           tolerance: float | None = None, no_dropout: bool = False) -> VerifyReport:
    """Probe ``setup`` under each factorization and compare with the 1-process reference.

    ``tolerance`` bounds the max relative difference of gradients and
    parameters (default by precision: 1e-4 for float32). ``no_dropout`` turns
    dropout off in every probe, so the rest of the setup can be checked. The probes run on
    CUDA when ``setup.accelerator`` is ``auto`` and every process can have a GPU.
    """
    setup = setup or ProbeSetup()
    factorizations = parse_factorizations(factorizations)
    tolerance = check_tolerance(setup, tolerance)
    setup = replace(setup, accelerator=resolve_accelerator(setup.accelerator, factorizations))
    base = frozenset({"no-dropout"} if no_dropout else ())
    with caller_rng_kept():
        traits = model_traits(setup.model_fn())
    # Diagnostic variants run alongside, so each world size needs one spawn only.
    variants = [base]
    if traits["batchnorm"]:
        variants.append(base | {"frozen-batchnorm"})
    if traits["dropout"] and not no_dropout:
        variants.append(base | {"no-dropout"})
        if traits["batchnorm"]:
            variants.append(base | {"no-dropout", "frozen-batchnorm"})
    reference_f = factorizations[0]
    jobs = [(f, v) for f in factorizations for v in variants]
    with caller_rng_kept():
        results = _run_all(setup, jobs)

    report = [FactorizationResult(reference_f, 0.0, 0.0, True, False, reference=True)]
    for f in factorizations[1:]:
        grad, param, data = _compare(results[(f, base)], results[(reference_f, base)][0])
        flagged = not data or max(grad, param) > tolerance
        result = FactorizationResult(f, grad, param, data, flagged)
        if flagged:
            result.causes = _diagnose(f, data, base, variants[1:], results, reference_f,
                                      tolerance)
        report.append(result)
    return VerifyReport(report, tolerance, setup.num_steps, setup.accelerator)


def check_tolerance(setup: ProbeSetup, tolerance: float | None) -> float:
    tolerance = DEFAULT_TOLERANCE[setup.precision] if tolerance is None else tolerance
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance}")
    return tolerance


def _diagnose(f: Factorization, data_matches: bool, base: frozenset[str],
              variants: list[frozenset[str]], results: dict, reference_f: Factorization,
              tolerance: float) -> list[str]:
    if not data_matches:
        return ["sampler"]
    # The smallest change to the model that makes the mismatch vanish names the cause.
    for variant in variants:
        grad, param, _ = _compare(results[(f, variant)], results[(reference_f, variant)][0])
        if max(grad, param) <= tolerance:
            return [cause for flag, cause in (("frozen-batchnorm", "batchnorm"),
                                              ("no-dropout", "dropout"))
                    if flag in variant - base]
    return ["loss"]


# -- command line ------------------------------------------------------------------
