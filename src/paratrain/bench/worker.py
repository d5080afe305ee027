"""One ``paratrain bench`` configuration: the training job every rank runs under the launcher.

Started as ``paratrain launch --nproc-per-node N -m paratrain.bench.worker --spec JOB.json
--out DIR``. Each training rank writes ``DIR/rank<R>.json``; a rank that fails writes
``DIR/error-rank<R>.json`` with a one-line reason. Ranks with a non-training role (a
parameter server) leave inside ``Run.prepare`` and write nothing.

Two timed phases, each after its own warm-up, in ``repeats`` windows of ``steps`` steps:

1. *compute*: forward + backward inside ``strategy.no_sync`` (no gradient communication);
2. *step*: the real training step, ``run.backward`` + ``run.step``;

the windows of the two phases alternate.

The difference, less a locally timed optimizer step, is the communication the strategy
could not hide behind computation.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEMO_MODEL = "paratrain.models:convnet"
OPTIMIZERS = ("adam", "sgd")
ACCELERATORS = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """What one launched configuration runs."""

    strategy: str
    """Registered strategy name, or a layout's degrees (``cp=2``, ``dp_shard=2,cp=2``) run
    as ``Run(parallel=...)``."""
    model: str = DEMO_MODEL
    """``module:callable`` returning an ``nn.Module``."""
    input_shape: tuple[int, ...] = (1, 28, 28)
    """Shape of one sample (synthetic random inputs)."""
    vocab_size: int | None = None
    """None: float inputs from ``torch.randn``. Set: int64 token ids below it (a language
    model's input, e.g. ``input_shape=(64,)`` for 64 tokens), and the loss is
    cross-entropy against random next tokens, so the output's last dimension must be it."""
    batch_size: int = 32
    """Samples per rank per step."""
    warmup_steps: int = 3
    """Untimed steps before each phase."""
    steps: int = 10
    """Steps per timed window."""
    repeats: int = 3
    """Timed windows per phase; the report gives their median and spread."""
    optimizer: str = "adam"
    """``adam`` or ``sgd``."""
    lr: float = 1e-3
    """Learning rate (speed does not depend on it)."""
    link_probe_bytes: int = 0
    """If > 0, also time all-reduces of this many bytes (and of 4 bytes) over the data-parallel group."""
    seed: int = 0
    """Seed of the model and the synthetic data."""
    precision: str = "32"
    """``Run``'s precision: ``32``, ``bf16-mixed``, ``16-mixed`` or ``bf16-true``."""
    accelerator: str = "auto"
    """``auto`` (CUDA when visible), ``cpu`` or ``cuda``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "input_shape", tuple(self.input_shape))
        if not self.input_shape or any(not isinstance(d, int) or d < 1 for d in self.input_shape):
            raise ValueError(f"input_shape must be positive integers, got {self.input_shape!r}")
        for name in ("batch_size", "steps", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("warmup_steps", "link_probe_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if self.vocab_size is not None and (isinstance(self.vocab_size, bool)
                                            or not isinstance(self.vocab_size, int)
                                            or self.vocab_size < 2):
            raise ValueError(f"vocab_size must be None or an integer >= 2, got {self.vocab_size!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if ":" not in self.model:
            raise ValueError(f"model must be 'module:callable', got {self.model!r}")
        from paratrain.config import PRECISIONS

        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {self.accelerator!r}")

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self)))

    @classmethod
    def read(cls, path: Path) -> JobSpec:
        return cls(**json.loads(Path(path).read_text()))


def load_factory(spec: str) -> Callable[[], Any]:
    """The callable named by ``module:callable`` (ValueError with the reason otherwise)."""
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"model must be 'module:callable', got {spec!r}")
    try:
        factory = importlib.import_module(module_name)
        for part in attr.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import model {spec!r}: {exc}") from None
    if not callable(factory):
        raise ValueError(f"model {spec!r} is not callable")
    return factory


def make_batch(spec: JobSpec, generator: Any) -> Any:
    """One synthetic batch of ``spec.batch_size`` samples: floats, or token ids when
    ``spec.vocab_size`` is set."""
    import torch

    shape = (spec.batch_size, *spec.input_shape)
    if spec.vocab_size is None:
        return torch.randn(*shape, generator=generator)
    return torch.randint(spec.vocab_size, shape, generator=generator)


def make_loss(output: Any, batch_size: int, generator: Any, *,
              vocab_size: int | None = None) -> Callable[[Any], Any]:
    """Classification outputs ``(batch, classes)`` get cross-entropy on random labels;
    anything else the mean square of the (first) output. With ``vocab_size``, the output
    is per-token logits ``(batch, ..., vocab_size)`` and the targets random tokens."""
    import torch
    import torch.nn.functional as F

    first = output[0] if isinstance(output, (tuple, list)) else output
    if vocab_size is not None:
        if first.dim() < 2 or first.shape[0] != batch_size or first.shape[-1] != vocab_size:
            raise ValueError(f"with vocab_size={vocab_size} the model must return logits "
                             f"(batch={batch_size}, ..., {vocab_size}), got {tuple(first.shape)}")
        targets = torch.randint(0, vocab_size, tuple(first.shape[:-1]), generator=generator)
        return TokenLoss(targets, vocab_size)
    if first.dim() == 2 and first.is_floating_point() and first.shape[0] == batch_size:
        labels = torch.randint(0, first.shape[1], (batch_size,), generator=generator)
        return lambda out: F.cross_entropy(out[0] if isinstance(out, (tuple, list)) else out,
                                           labels.to(out.device if hasattr(out, "device") else "cpu"))
    return lambda out: (out[0] if isinstance(out, (tuple, list)) else out).float().pow(2).mean()


@dataclass(frozen=True)
class TokenLoss:
    """Cross-entropy of per-token logits ``(batch, ..., vocab_size)`` against ``targets``."""

    targets: Any
    vocab_size: int

    def __call__(self, out: Any) -> Any:
        import torch.nn.functional as F

        logits = out[0] if isinstance(out, (tuple, list)) else out
        return F.cross_entropy(logits.reshape(-1, self.vocab_size).float(),
                               self.targets.reshape(-1).to(logits.device))


def local_tokens(run: Any, batches: list, loss_fn: Callable) -> tuple[list, Callable]:
    """This rank's part of token batches and targets (context parallel: a slice of each
    sequence, the same positions for inputs and targets); unchanged without one."""
    if not isinstance(loss_fn, TokenLoss):
        return batches, loss_fn
    parts = [run.strategy.local_batch((x, loss_fn.targets)) for x in batches]
    return [x for x, _ in parts], TokenLoss(parts[0][1], loss_fn.vocab_size)


def _timed_optimizer_step(model: Any, spec: JobSpec, device: Any, repeats: int = 5) -> float:
    """Median seconds of one local optimizer step on a copy of the parameters on ``device``."""
    import torch

    from paratrain.distributed.gpu_stats import synchronize

    params = [p.detach().to(device).clone().requires_grad_(True) for p in model.parameters()]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = _optimizer(params, spec)
    times = []
    for _ in range(repeats + 1):
        synchronize(device)
        t0 = time.perf_counter()
        opt.step()
        synchronize(device)  # the step's kernels are only queued when step() returns
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _warm_imports(spec: JobSpec) -> None:
    """The optimizer's first step imports modules lazily (~150 MB RSS with torch 2.x):
    take it on a one-element tensor so the memory baseline is really "after imports"."""
    import torch

    weight = torch.zeros(1, requires_grad=True)
    weight.grad = torch.zeros(1)
    _optimizer([weight], spec).step()


def _optimizer(params: Any, spec: JobSpec) -> Any:
    import torch

    if spec.optimizer == "sgd":
        return torch.optim.SGD(params, lr=spec.lr, momentum=0.9)
    return torch.optim.Adam(params, lr=spec.lr)


def _link_probe(run: Any, num_bytes: int, repeats: int = 7) -> dict[str, float]:
    """Fastest all-reduce time of ``num_bytes`` and of 4 bytes over the data-parallel group
    (over all ranks when there is no data parallelism).

    The minimum, not the median: other load on the machine only ever adds time, and the
    link's capability is what is being measured. A plain ``torch.distributed`` collective,
    not the strategy's: a strategy may add protocol work to its own (the parameter
    server parks its workers at the servers first), which is not the link's cost.
    """
    import torch
    import torch.distributed as dist

    from paratrain.distributed.gpu_stats import synchronize

    if not dist.is_initialized():
        return {}
    # Without data parallelism (a pipeline) the links between all ranks are what counts.
    group, ranks = run.strategy.data_parallel_group, run.strategy.data_parallel_size
    if ranks < 2:
        group, ranks = None, dist.get_world_size()
    if ranks < 2:
        return {}
    out: dict[str, float] = {"link_probe_bytes": float(num_bytes), "link_probe_ranks": ranks}
    for key, n in (("link_probe_s", num_bytes), ("link_small_s", 4)):
        tensor = torch.ones(max(1, n // 4), device=run.device)
        dist.all_reduce(tensor, group=group)  # warm-up: connections are set up lazily
        times = []
        for _ in range(repeats):
            synchronize(run.device)
            t0 = time.perf_counter()
            dist.all_reduce(tensor, group=group)
            synchronize(run.device)  # NCCL's all_reduce returns once queued
            times.append(time.perf_counter() - t0)
        out[key] = min(times)
    return out


def _phases(run: Any, model: Any, optimizer: Any, batches: list, loss_fn: Callable,
            spec: JobSpec, util: Any) -> tuple[list[float], list[float]]:
    """Seconds per step of each timed window (this rank's): compute-only and synced.

    The windows alternate (compute, step, compute, step, ...) so that a change in the
    machine's load affects both phases alike instead of biasing their difference.
    """
    import torch

    from paratrain.distributed.gpu_stats import synchronize

    def one(i: int, sync: bool) -> None:
        x = batches[i % len(batches)]
        if sync:
            run.backward(loss_fn(model(x)))
            run.step(optimizer)
        else:
            with run.strategy.no_sync(model):
                run.backward(loss_fn(model(x)))
            optimizer.zero_grad(set_to_none=True)

    def window(sync: bool) -> float:
        run.strategy.all_reduce(torch.zeros(1, device=run.device))  # start together
        synchronize(run.device)  # neither the warm-up nor the last window's work may leak in
        if sync:
            util.start()
        t0 = time.perf_counter()
        for i in range(spec.steps):
            one(i, sync)
            if sync and i == spec.steps // 2:
                util.sample_gpu()
        synchronize(run.device)
        elapsed = (time.perf_counter() - t0) / spec.steps
        if sync:
            util.accumulate()
        return elapsed

    for sync in (False, True):
        for i in range(spec.warmup_steps):
            one(i, sync)
    compute, step = [], []
    for _ in range(spec.repeats):
        compute.append(window(False))
        step.append(window(True))
    return compute, step


def run_job(spec: JobSpec, out_dir: Path) -> dict[str, Any]:
    """Run the two phases on this rank and write ``rank<R>.json``; returns what was written."""
    import torch

    import paratrain
    from paratrain.bench.measure import MemoryWatch, Utilisation, state_bytes

    factory = load_factory(spec.model)
    # A layout row (``cp=2``) names degrees; the layout picks its strategy.
    layout = {"parallel": spec.strategy} if "=" in spec.strategy else {"strategy": spec.strategy}
    with paratrain.Run(**layout, progress=False, seed=spec.seed,
                       precision=spec.precision, accelerator=spec.accelerator) as run:
        _warm_imports(spec)
        memory = MemoryWatch(run.device)
        model = factory()
        # Seeded by the data-parallel rank: the ranks of one tensor-parallel group must
        # read the same batch and targets, as in real training.
        generator = torch.Generator().manual_seed(
            spec.seed + 17 * run.strategy.data_parallel_rank)
        batches = [make_batch(spec, generator) for _ in range(2)]
        with torch.no_grad():
            loss_fn = make_loss(model(batches[0]), spec.batch_size, generator,
                                vocab_size=spec.vocab_size)
        optimizer_step_s = _timed_optimizer_step(model, spec, run.device)
        optimizer = _optimizer(model.parameters(), spec)
        model, optimizer = run.prepare(model, optimizer)  # a server rank leaves here
        batches, loss_fn = local_tokens(run, batches, loss_fn)
        batches = [b.to(run.device) for b in batches]
        probe = _link_probe(run, spec.link_probe_bytes) if spec.link_probe_bytes else {}
        util = Utilisation(run.device)
        compute, step = _phases(run, model, optimizer, batches, loss_fn, spec, util)
        usage = util.result()
        # Gradients exist only between backward and step: count them on one extra step.
        run.backward(loss_fn(model(batches[0])))
        held = state_bytes(model, optimizer)
        run.step(optimizer)
        # The slowest rank sets the pace of a synchronous job.
        times = run.strategy.all_reduce(
            torch.tensor(compute + step, dtype=torch.float64, device=run.device), "max").cpu()
        result = {
            "rank": run.rank, "world_size": run.world_size,
            "data_parallel_size": run.strategy.data_parallel_size,
            "strategy": run.strategy.name, "notice": run.strategy.notice(),
            "device": str(run.device), "precision": spec.precision, "batch_size": spec.batch_size, "steps": spec.steps,
            "repeats": spec.repeats,
            "samples_per_step": spec.batch_size * run.strategy.data_parallel_size,
            "compute_step_s": times[:spec.repeats].tolist(),
            "step_s": times[spec.repeats:].tolist(),
            "own_step_s": step, "optimizer_step_s": optimizer_step_s,
            "baseline_memory_bytes": memory.baseline,
            "peak_memory_above_baseline_bytes": memory.peak_above_baseline(),
            "param_bytes": held.param_bytes, "grad_bytes": held.grad_bytes,
            "optimizer_bytes": held.optimizer_bytes, **usage, **probe,
        }
        (out_dir / f"rank{run.rank}.json").write_text(json.dumps(result, indent=1))
        return result


def _write_error(out_dir: Path, exc: BaseException) -> None:
    import os

    rank = os.environ.get("RANK", "0")
    text = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    payload = {"rank": int(rank), "reason": reason, "traceback": traceback.format_exc()}
    (out_dir / f"error-rank{rank}.json").write_text(json.dumps(payload, indent=1))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="paratrain.bench.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--spec", required=True, type=Path, help="JobSpec as JSON")
    parser.add_argument("--out", required=True, type=Path, help="directory for rank<R>.json")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        run_job(JobSpec.read(args.spec), args.out)
    except SystemExit:
        raise  # a server rank finished its role
    except BaseException as exc:
        _write_error(args.out, exc)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
