"""``paratrain verify --resume``: does a run resumed from a checkpoint continue exactly?

For a setup and each factorization (``world_size x micro_batch x accumulate`` under the
setup's strategy) three short runs train, each in a process group of its own:

1. uninterrupted, for ``k + 1`` optimizer steps;
2. ``k`` steps, then ``run.save()``, then the run ends (as if stopped);
3. a fresh run that resumes from that checkpoint and trains step ``k + 1``.

Every rank records, at step ``k`` (run 3: right after loading) and after step ``k + 1``,
the step counter, the samples it read for the step, its data cursor, its RNG states,
its buffers, its parameters (its shard or stage) and its optimizer state. Each must be
bitwise equal to the uninterrupted run's. The first that is not is named, in that order
(causes before effects: another batch or dropout mask changes all that follows), e.g.
``resume: differs after loading step 2: buffer '1.running_mean' on rank 0 (max abs diff
2.1e-04)``.

The optimizer is AdamW (each parameter has a step count and two moments), not the plain
SGD of the gradient probes, whose state is empty.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from paratrain.checkpoint.files import rng_state
from paratrain.distributed.device import free_port
from paratrain.distributed.dtensor import local_piece
from paratrain.distributed.spawn import spawn
from paratrain.run.core import Run
from paratrain.strategies.capabilities import local_module
from paratrain.verify.probe import Factorization, ProbeSetup, fingerprint, resolve_accelerator
from paratrain.verify.runner import caller_rng_kept

CATEGORIES = ("step counter", "samples", "data cursor", "RNG state", "buffer", "parameter",
              "optimizer state")
"""What each rank records, in the order it is compared."""

Snapshot = dict[str, dict[str, Any]]
"""category -> rendered name ('' when the category is one value) -> value, one rank's."""

_MISSING = object()


def _plain(value: Any) -> Any:
    """A tensor's local piece, detached on the CPU; other values as they are."""
    if isinstance(value, torch.Tensor):
        return local_piece(value).detach().cpu().clone()
    return value


def snapshot(run: Run, model: Any, optimizer: torch.optim.Optimizer, loader: Any,
             samples: torch.Tensor | None) -> Snapshot:
    """This rank's state: what a checkpoint must restore for the next step to be the same."""
    module = local_module(run.strategy, model)
    names = {id(p): name for name, p in module.named_parameters()}
    # A sharded optimizer (ZeroRedundancyOptimizer) keeps this rank's state in its inner one.
    state = getattr(optimizer, "optim", optimizer).state
    cursor = getattr(loader, "cursor", None)
    return {
        "step counter": {"": run.global_step},
        "samples": {} if samples is None else {"": samples},
        "data cursor": {} if cursor is None else {"": torch.tensor([cursor.epoch,
                                                                    cursor.offset])},
        "RNG state": {"": rng_state()},
        "buffer": {f"'{n}'": _plain(b) for n, b in module.named_buffers()},
        "parameter": {f"'{n}'": _plain(p) for n, p in module.named_parameters()},
        "optimizer state": {f"{key} of '{names.get(id(param), '?')}'": _plain(value)
                            for param, values in state.items() for key, value in values.items()},
    }


def _difference(expected: Any, got: Any) -> str | None:
    """How ``got`` differs from ``expected`` in a few words, or None when bitwise equal."""
    if expected is _MISSING or got is _MISSING:
        return "missing after resuming" if got is _MISSING else "only after resuming"
    if not isinstance(expected, torch.Tensor) or not isinstance(got, torch.Tensor):
        return None if expected == got else f"uninterrupted {expected}, resumed {got}"
    if expected.shape != got.shape or expected.dtype != got.dtype:
        return (f"uninterrupted {tuple(expected.shape)} {expected.dtype}, "
                f"resumed {tuple(got.shape)} {got.dtype}")
    same = expected == got
    if expected.is_floating_point():
        same |= expected.isnan() & got.isnan()
    if bool(same.all()):
        return None
    if expected.is_floating_point():
        return f"max abs diff {(expected - got).abs().nan_to_num(float('inf')).max().item():.1e}"
    if expected.numel() <= 4:
        return f"uninterrupted {expected.tolist()}, resumed {got.tolist()}"
    return f"{int((~same).sum())} of {expected.numel()} values differ"


def first_difference(expected: Sequence[Snapshot], got: Sequence[Snapshot]) -> str | None:
    """The first category, rank and name whose value differs, as ``what on rank r (how)``."""
    for category in CATEGORIES:
        for rank, (mine, theirs) in enumerate(zip(expected, got)):
            want, have = mine.get(category, {}), theirs.get(category, {})
            for name in [*want, *(n for n in have if n not in want)]:
                how = _difference(want.get(name, _MISSING), have.get(name, _MISSING))
                if how is not None:
                    return f"{category} {name}".strip() + f" on rank {rank} ({how})"
    return None


def _train(setup: ProbeSetup, f: Factorization, *, steps: int, marks: tuple[int, ...],
           checkpoint_dir: str, save: bool = False, resumed: bool = False,
           environ: dict[str, str] | None = None) -> dict[Any, Snapshot]:
    """Train to ``steps`` optimizer steps; snapshots at ``marks`` (and ``"loaded"``)."""
    one = f.world_size == 1
    run = Run(strategy="single" if one else setup.strategy,
              strategy_options={} if one else dict(setup.strategy_options),
              accumulate=f.accumulate, seed=setup.seed, precision=setup.precision,
              accelerator=setup.accelerator, progress=False,
              nan="warn",  # a probe observes: a NaN micro-batch mean is what it may report
              checkpoint_dir=checkpoint_dir if resumed or save else None, environ=environ)
    try:
        model = setup.model_fn()
        optimizer = torch.optim.AdamW(model.parameters(), lr=setup.lr)
        model, optimizer = run.prepare(model, optimizer)
        loader = setup.loader_fn(run, setup.data_fn(), f.micro_batch)
        snaps: dict[Any, Snapshot] = {}
        samples: list[torch.Tensor] = []
        for _ in run.epochs(10**9):
            if resumed and "loaded" not in snaps:  # the checkpoint is loaded by now
                snaps["loaded"] = snapshot(run, model, optimizer, loader, None)
            num_batches = 0
            for batch in loader:
                num_batches += 1
                before = run.global_step
                samples.append(fingerprint(batch))
                setup.step_fn(run, model, batch)
                run.step(optimizer)
                if run.global_step != before:  # an optimizer step ended: its samples
                    step_samples, samples = torch.cat(samples), []
                    if run.global_step in marks:
                        snaps[run.global_step] = snapshot(
                            run, model, optimizer, loader,
                            step_samples if run.global_step == steps else None)
                if run.global_step >= steps:
                    break
            if run.global_step >= steps:
                break
            if num_batches == 0:
                raise ValueError("the loader yielded no batches; give verify more data")
        if save:
            run.save()
        return snaps
    finally:
        run.close()


def _three_runs(setup: ProbeSetup, f: Factorization, directory: str, ports: list[int] | None,
                environ: dict[str, str] | None = None) -> dict[str, dict[Any, Snapshot]]:
    k = setup.num_steps
    runs = (("uninterrupted", {"steps": k + 1, "marks": (k, k + 1)}),
            ("stopped", {"steps": k, "marks": (), "save": True}),
            ("resumed", {"steps": k + 1, "marks": (k + 1,), "resumed": True}))
    result = {}
    for index, (label, kwargs) in enumerate(runs):
        if ports is not None:
            # A fresh process group per run, on a port of its own: re-creating one on the
            # port of a destroyed group can wait forever.
            os.environ["MASTER_PORT"] = str(ports[index])
        result[label] = _train(setup, f, checkpoint_dir=directory, environ=environ, **kwargs)
    return result


def resume_worker(rank: int, world_size: int, setup: ProbeSetup, f: Factorization,
                  directory: str, ports: list[int]) -> dict[str, dict[Any, Snapshot]]:
    """Entry point of each rank (``spawn``): the three runs, each forming its own group."""
    return _three_runs(setup, f, directory, ports)


@dataclass
class ResumeResult:
    """One factorization: None when the resumed run continues bitwise, else what differs."""

    factorization: Factorization
    strategy: str
    difference: str | None

    @property
    def ok(self) -> bool:
        return self.difference is None


@dataclass
class ResumeReport:
    """All factorizations' results; ``ok`` when every resume is exact."""

    results: list[ResumeResult]
    stop_at: int
    accelerator: str = "cpu"

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def format(self) -> str:
        k = self.stop_at
        lines = [f"verify --resume: train {k} steps, save, resume in a fresh process group; "
                 f"steps {k} and {k + 1} must equal an uninterrupted run bitwise, on "
                 f"{self.accelerator}"]
        for r in self.results:
            lines.append(f"{r.factorization.label:<10}{r.strategy:<10}"
                         f"{'ok' if r.ok else r.difference}")
        lines.append("resume is exact" if self.ok else
                     "resume is not exact: the first difference is named above")
        return "\n".join(lines)


def compare(runs: list[dict[str, dict[Any, Snapshot]]], k: int) -> str | None:
    """``resume: differs ...`` for the first difference over the ranks' runs, or None."""
    for label, mark, key in ((f"after loading step {k}", k, "loaded"),
                             (f"at step {k + 1}", k + 1, k + 1)):
        expected = [r["uninterrupted"].get(mark) for r in runs]
        got = [r["resumed"].get(key) for r in runs]
        if any(s is None for s in expected + got):
            return f"resume: differs {label}: the resumed run did not reach it"
        found = first_difference(expected, got)
        if found:
            return f"resume: differs {label}: {found}"
    return None


def verify_resume(setup: ProbeSetup | None = None, *,
                  factorizations: Sequence[str | Factorization] = ("2x4x1",)) -> ResumeReport:
    """Stop each factorization's run after ``setup.num_steps`` steps, resume it, compare.

    Multi-process factorizations run as local ranks (``paratrain.distributed.spawn``);
    each of the three runs forms its own process group.
    """
    setup = setup or ProbeSetup()
    parsed = [f if isinstance(f, Factorization) else Factorization.parse(f)
              for f in factorizations]
    if not parsed:
        raise ValueError("factorizations must name at least one WORLDxMICROxACCUM")
    setup = replace(setup, accelerator=resolve_accelerator(setup.accelerator, parsed))
    results = []
    for f in dict.fromkeys(parsed):
        with tempfile.TemporaryDirectory(prefix="paratrain-verify-resume-") as directory:
            if f.world_size == 1:
                with caller_rng_kept():
                    runs = [_three_runs(setup, f, directory, None, environ={})]
            else:
                ports = [free_port() for _ in range(3)]
                runs = spawn(resume_worker, f.world_size, setup, f, directory, ports,
                             timeout=setup.timeout_s * 3, accelerator=setup.accelerator)
        strategy = "single" if f.world_size == 1 else setup.strategy
        results.append(ResumeResult(f, strategy, compare(runs, setup.num_steps)))
    return ResumeReport(results, setup.num_steps, setup.accelerator)
