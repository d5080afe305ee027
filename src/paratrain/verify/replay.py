"""``paratrain verify --replay``: does every step compute the same bits twice, on every rank?

Silent data corruption (a nondeterministic kernel, a faulty device, a rank whose
replicated copy drifted) changes numbers without raising. For a setup and each
factorization (``world_size x micro_batch x accumulate`` under the setup's strategy)
every rank trains ``k`` optimizer steps, then trains them again: the replay is a fresh
``Run`` with the same seed in the same processes and process group, so it starts from
the same parameters, RNG states and data order, and every step of it starts from the
state of the first run's step exactly when the training is deterministic. Each rank
records per step the digests (:mod:`paratrain.verify.digests`) of its losses (as given
to ``run.backward``), its gradients as the optimizer sees them (reduced; its local
piece where sharded), its buffers and its parameters after the step. Two checks:

* **replay**: each rank's digests equal its first run's, step by step;
* **replicas**: tensors the layout replicates are bitwise equal on every rank holding a
  copy; a majority vote names the odd rank out.

The first difference is named, e.g. ``replay    differs at step 1: gradient '0.weight'
on rank 1 (first run float32[16,6]:5f1c0e22, replay float32[16,6]:5f1c0e23)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from paratrain.distributed.spawn import spawn
from paratrain.run.core import Run
from paratrain.strategies.capabilities import local_module
from paratrain.verify.digests import (
    CheckResult,
    RankDigests,
    TensorDigest,
    compare_replay,
    compare_replicas,
    tensor_digests,
)
from paratrain.verify.probe import Factorization, ProbeSetup, resolve_accelerator
from paratrain.verify.runner import caller_rng_kept

PLAIN_REPLICATED = ("single", "ddp", "zero1", "pipeline")
"""Strategies whose plain (non-DTensor) parameters are whole copies on every rank that
holds them (a pipeline stage's on its data-parallel peers). Under the others only
DTensors are compared across ranks: their placements say which pieces are copies."""


def _batch_statistics(module: nn.Module) -> list[str]:
    """Buffers each rank updates from its own batch (BatchNorm's running statistics):
    they differ across data-parallel ranks by design, so only the replay compares them."""
    names = []
    for prefix, sub in module.named_modules():
        if (isinstance(sub, nn.modules.batchnorm._BatchNorm)
                and not isinstance(sub, nn.SyncBatchNorm)):
            names += [f"{prefix}.{n}" if prefix else n for n, _ in sub.named_buffers()]
    return names


def train_digests(setup: ProbeSetup, f: Factorization, *,
                  environ: dict[str, str] | None = None) -> RankDigests:
    """Train ``setup.num_steps`` optimizer steps under ``f``; this rank's digests per step."""
    one = f.world_size == 1
    run = Run(strategy="single" if one else setup.strategy,
              strategy_options={} if one else dict(setup.strategy_options),
              accumulate=f.accumulate, seed=setup.seed, precision=setup.precision,
              accelerator=setup.accelerator, progress=False, environ=environ,
              nan="warn")  # a probe observes: a NaN micro-batch mean is what it may report
    try:
        model = setup.model_fn()
        optimizer = torch.optim.SGD(model.parameters(), lr=setup.lr)
        model, optimizer = run.prepare(model, optimizer)
        module = local_module(run.strategy, model)
        plain = one or setup.strategy in PLAIN_REPLICATED
        local_only = _batch_statistics(module)
        params = list(module.named_parameters())
        losses: list[torch.Tensor] = []
        grads: list[TensorDigest] = []
        backward = run.backward

        def recording_backward(loss: torch.Tensor, **kwargs: Any) -> None:
            backward(loss, **kwargs)
            losses.append(loss.detach())  # after backward: a pipeline's loss is set then

        # The step function calls run.backward; this instance attribute records its loss.
        run.backward = recording_backward  # type: ignore[method-assign]
        optimizer.register_step_pre_hook(lambda *_: grads.extend(tensor_digests(
            "gradient", ((n, p.grad) for n, p in params), plain_replicated=plain)))
        loader = setup.loader_fn(run, setup.data_fn(), f.micro_batch)
        record: RankDigests = {}
        for _ in run.epochs(10**9):
            num_batches = 0
            for batch in loader:
                num_batches += 1
                setup.step_fn(run, model, batch)
                if run.step(optimizer):
                    record[run.global_step] = [
                        *tensor_digests("loss", ((f"micro-batch {i}", loss) for i, loss
                                                 in enumerate(losses)), plain_replicated=False),
                        *grads,
                        *tensor_digests("buffer", module.named_buffers(), plain_replicated=plain,
                                        local_only=local_only),
                        *tensor_digests("parameter", params, plain_replicated=plain)]
                    losses.clear()
                    grads.clear()
                if run.global_step >= setup.num_steps:
                    break
            if run.global_step >= setup.num_steps:
                break
            if num_batches == 0:
                raise ValueError("the loader yielded no batches; give verify more data")
        return record
    finally:
        run.close()


def first_and_replay(setup: ProbeSetup, f: Factorization, *,
                     environ: dict[str, str] | None = None) -> tuple[RankDigests, RankDigests]:
    """The first run and its replay, one after the other in this process."""
    return (train_digests(setup, f, environ=environ), train_digests(setup, f, environ=environ))


def replay_worker(rank: int, world_size: int, setup: ProbeSetup,
                  f: Factorization) -> tuple[RankDigests, RankDigests]:
    """Entry point of each rank (``spawn``): both runs under one process group."""
    from paratrain.distributed.process_group import init_process_group
    from paratrain.distributed.topology import Topology

    # One group for both runs: each Run reuses it, so the replay's collectives run on
    # the same communicator as the first run's.
    init_process_group(Topology.from_env(accelerator=setup.accelerator),
                       timeout_s=setup.timeout_s)
    return first_and_replay(setup, f)


@dataclass
class ReplayResult:
    """One factorization: the replay check and the cross-rank check."""

    factorization: Factorization
    strategy: str
    replay: CheckResult
    replicas: CheckResult

    @property
    def ok(self) -> bool:
        return self.replay.ok and self.replicas.ok


@dataclass
class ReplayReport:
    """All factorizations' results; ``ok`` when every digest matched."""

    results: list[ReplayResult]
    num_steps: int
    accelerator: str = "cpu"

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.results)

    def format(self) -> str:
        """One line per check and factorization, then the verdict."""
        lines = [f"verify --replay: {self.num_steps} steps trained twice from one seed; "
                 "digests of losses, gradients, buffers and parameters must equal the first "
                 f"run's and agree across replicas, bitwise, on {self.accelerator}"]
        for r in self.results:
            head = f"{r.factorization.label:<10}{r.strategy:<10}"
            replay = r.replay
            lines.append(f"{head}{'replay':<10}" + (
                f"ok ({replay.compared} digests)" if replay.ok else replay.mismatch.format()))
            replicas = r.replicas
            if replicas.ok:
                text = (f"ok ({replicas.compared} replicated tensors)" if replicas.compared
                        else "ok (no replicated tensors to compare)")
            else:
                text = replicas.mismatch.format()
            lines.append(f"{head}{'replicas':<10}{text}")
        lines.append("every step replays bitwise and replicas agree" if self.ok else
                     "replay found a difference: the first one is named above")
        return "\n".join(lines)


def verify_replay(setup: ProbeSetup | None = None, *,
                  factorizations: Sequence[str | Factorization] = ("2x4x1",)) -> ReplayReport:
    """Train each factorization twice from ``setup.seed`` and compare the digests.

    Multi-process factorizations run as local ranks (``paratrain.distributed.spawn``),
    one process group per factorization shared by both runs.
    """
    setup = setup or ProbeSetup()
    parsed = [f if isinstance(f, Factorization) else Factorization.parse(f)
              for f in factorizations]
    if not parsed:
        raise ValueError("factorizations must name at least one WORLDxMICROxACCUM")
    setup = replace(setup, accelerator=resolve_accelerator(setup.accelerator, parsed))
    results = []
    for f in dict.fromkeys(parsed):
        if f.world_size == 1:
            with caller_rng_kept():
                runs = [first_and_replay(setup, f, environ={})]
        else:
            runs = spawn(replay_worker, f.world_size, setup, f,
                         timeout=setup.timeout_s * 2, accelerator=setup.accelerator)
        firsts, replays = [r[0] for r in runs], [r[1] for r in runs]
        strategy = "single" if f.world_size == 1 else setup.strategy
        results.append(ReplayResult(f, strategy, compare_replay(firsts, replays),
                                    compare_replicas(firsts)))
    return ReplayReport(results, setup.num_steps, setup.accelerator)
