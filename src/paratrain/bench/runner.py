"""``paratrain bench``: measure every registered strategy at several world sizes.

On a machine with CUDA the default rows are the seeds' comparison table: ``single``,
``ddp``, ``ddp+bf16-mixed``, ``fsdp`` and ``dp`` (see :mod:`paratrain.bench.rows`); on CPU
every registered strategy. Both come from the strategy table
(:mod:`paratrain.strategies.table`), as do the per-strategy facts the bench needs (one
process only, parameter-server processes and their launcher flag). Each row x world size
runs as its own job through the real launcher (``paratrain launch ... -m
paratrain.bench.worker``) on synthetic data of the model's input shape, with warm-up and
repeated timing windows. A strategy that cannot run a configuration is listed as skipped
with the reason. A row may also be a layout of degrees (``cp=2``, ``ep=2``; see
:mod:`paratrain.bench.layouts`), run as ``Run(parallel=...)``.

Example::

    from paratrain.bench.runner import bench
    report = bench(model="my_module:build", input_shape=(3, 32, 32), world_sizes=(1, 2),
                   strategies=("ddp", "ddp+bf16-mixed"))
    print(report.format_table())
    report.write_json("bench.json"); report.write_csv("bench.csv"); report.plot("bench.png")
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from paratrain.bench import jobs as bench_jobs
from paratrain.bench.layouts import (
    TOKEN_WORKLOADS,
    ModelFacts,
    layout_refusal,
    model_facts,
    pick_model,
)
from paratrain.bench.report import BenchReport, BenchRow, add_scaling_efficiency, row_from_results
from paratrain.bench.rows import (
    ACCELERATORS,
    REFERENCE,
    RowSpec,
    default_world_sizes,
    gpu_shortfall,
    parse_precisions,
    resolve_accelerator,
    resolve_rows,
)
from paratrain.bench.worker import JobSpec, load_factory

__all__ = ["BenchConfig", "bench", "preflight", "resolve_strategies"]


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    """What ``paratrain bench`` measures and how long it may take."""

    model: str | None = None
    """``module:callable`` returning the ``nn.Module``; None: the demo ConvNet, or the bench's
    GPT (:mod:`paratrain.bench.layouts`) when a row has ``cp``, its MoE GPT when one has ``ep``."""
    input_shape: tuple[int, ...] | None = None
    """Shape of one sample; inputs are random tensors of this shape. None: the token
    workloads' ``(64,)``, else ``(1, 28, 28)``."""
    vocab_size: int | None = None
    """Set: inputs are int64 token ids below it (a language model); None: the token
    workloads' vocabulary, else float inputs."""
    strategies: tuple[str, ...] | None = None
    """Rows: ``STRATEGY`` or ``STRATEGY+PRECISION`` (e.g. ``ddp+bf16-mixed``), or a layout of
    degrees (``cp=2``, ``dp_shard=2,cp=2``, ``ep=2``); None means the seeds' table
    (``single, ddp, ddp+bf16-mixed, fsdp, dp``) on CUDA, else every registered one."""
    precisions: tuple[str, ...] = ("32",)
    """Precisions each ``STRATEGY`` without ``+PRECISION`` is measured at."""
    accelerator: str = "auto"
    """``auto`` (CUDA when visible, as ``Run`` picks), ``cpu`` or ``cuda``."""
    world_sizes: tuple[int, ...] | None = None
    """Numbers of training processes (parameter servers come on top); None: 1 and 2 on CPU,
    1 and the number of visible GPUs on CUDA."""
    batch_size: int = 32
    """Samples per training process per step."""
    warmup_steps: int = 3
    """Untimed steps before each timed phase."""
    steps: int = 10
    """Steps per timed window."""
    repeats: int = 3
    """Timed windows per configuration (median and min-max are reported)."""
    optimizer: str = "adam"
    """``adam`` or ``sgd``."""
    epoch_samples: int = 60_000
    """Samples in one epoch, for seconds per epoch (Fashion-MNIST's 60,000 by default)."""
    threads: int | None = None
    """OMP threads per process; None keeps the launcher's split of the cores."""
    timeout_s: float = 600.0
    """Seconds one configuration may take before it is killed and marked failed."""
    link_probe_bytes: int = 0
    """If > 0, each job also times all-reduces of this size to report the link bandwidth."""

    def __post_init__(self) -> None:
        if self.model is None:
            object.__setattr__(self, "model", pick_model(self.strategies))
        workload = TOKEN_WORKLOADS.get(self.model)
        if self.input_shape is None:
            object.__setattr__(self, "input_shape", workload[0] if workload else (1, 28, 28))
        if self.vocab_size is None and workload:
            object.__setattr__(self, "vocab_size", workload[1])
        object.__setattr__(self, "input_shape", tuple(self.input_shape))
        object.__setattr__(self, "precisions", parse_precisions(self.precisions))
        if self.accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {self.accelerator!r}")
        if self.world_sizes is None:
            object.__setattr__(self, "world_sizes",
                               default_world_sizes(resolve_accelerator(self.accelerator)))
        object.__setattr__(self, "world_sizes", tuple(self.world_sizes))
        if self.strategies is not None:
            object.__setattr__(self, "strategies", tuple(self.strategies))
            if not self.strategies:
                raise ValueError("strategies must name at least one strategy (or be None for all)")
        if not self.world_sizes or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                       for n in self.world_sizes):
            raise ValueError(f"world_sizes must be integers >= 1, got {self.world_sizes!r}")
        if not isinstance(self.epoch_samples, int) or self.epoch_samples < 1:
            raise ValueError(f"epoch_samples must be an integer >= 1, got {self.epoch_samples!r}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"threads must be an integer >= 1 or None, got {self.threads!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")
        self.job_spec(REFERENCE)  # the per-job fields are validated by JobSpec

    def job_spec(self, strategy: str, precision: str = "32", accelerator: str = "auto") -> JobSpec:
        return JobSpec(strategy=strategy, model=self.model, input_shape=self.input_shape,
                       vocab_size=self.vocab_size, batch_size=self.batch_size, warmup_steps=self.warmup_steps,
                       steps=self.steps, repeats=self.repeats, optimizer=self.optimizer,
                       link_probe_bytes=self.link_probe_bytes, precision=precision,
                       accelerator=accelerator)


def resolve_strategies(requested: Sequence[str] | None, *, cuda: bool = False) -> list[str]:
    """Row labels (``ddp``, ``ddp+bf16-mixed``), the reference first; ``None``: every registered
    strategy, or the seeds' table on CUDA. Unknown names are a ValueError listing the choices."""
    return [r.label for r in resolve_rows(requested, accelerator="cuda" if cuda else "cpu")]


def check_model(config: BenchConfig) -> ModelFacts:
    """Build the model and run one forward pass on 2 samples, so a wrong ``model`` or
    ``input_shape`` fails here with one line instead of in every launched job; returns
    what layout rows need to know of it."""
    import torch
    from torch import nn

    model = load_factory(config.model)()
    if not isinstance(model, nn.Module):
        raise ValueError(f"model {config.model!r} returned {type(model).__name__}, not an nn.Module")
    sample = (torch.randn(2, *config.input_shape) if config.vocab_size is None
              else torch.randint(config.vocab_size, (2, *config.input_shape)))
    try:
        return model_facts(model, sample, config.model, vocab_size=config.vocab_size)
    except Exception as exc:  # shape mismatch and the like: the input shape's fault
        text = str(exc).strip().splitlines()
        raise ValueError(f"input_shape {config.input_shape}: forward of {config.model!r} failed: "
                         f"{type(exc).__name__}: {text[0] if text else ''}") from None


def preflight(strategy: str, world_size: int, accelerator: str = "cpu",
              facts: ModelFacts | None = None) -> str:
    """Why ``strategy`` (or a layout row, ``cp=2``, with the model's ``facts``) cannot run on
    ``world_size`` processes, or "" when it may."""
    from paratrain.strategies.table import strategy_entry

    if "=" in strategy:
        return layout_refusal(strategy, world_size, facts) or gpu_shortfall(world_size,
                                                                            accelerator)
    entry = strategy_entry(strategy)
    try:
        entry.load_class()
    except ImportError as exc:  # registered, but its module is missing or broken
        return f"cannot import strategy {strategy!r}: {exc}".splitlines()[0]
    if entry.single_process and world_size > 1:
        # Its own refusal names the alternative; otherwise say what would happen.
        return (_refusal(strategy, world_size)
                or f"'{strategy}' is one process (it would train {world_size} unrelated copies)")
    shortfall = gpu_shortfall(world_size + entry.server_processes, accelerator)
    if shortfall:
        return shortfall
    if entry.server_processes:
        return ""  # its layout depends on the launcher's server flag: let the job decide
    return _refusal(strategy, world_size)


def _refusal(strategy: str, world_size: int) -> str:
    """The strategy's own one-line refusal of ``world_size`` processes, or ""."""
    from paratrain.distributed.topology import Topology
    from paratrain.strategies import create_strategy

    topology = Topology(rank=0, world_size=world_size, local_world_size=world_size)
    try:
        create_strategy(strategy, topology)
    except ValueError as exc:
        return str(exc).strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - needs a live process group: the job will tell
        return ""
    return ""


def run_one(config: BenchConfig, strategy: str, world_size: int, workdir: Path, *,
            precision: str = "32", accelerator: str = "cpu",
            facts: ModelFacts | None = None) -> BenchRow:
    """Launch one configuration and aggregate its ranks' results."""
    kept = {"precision": precision, "device": accelerator}
    reason = preflight(strategy, world_size, accelerator, facts)
    if reason:
        return BenchRow(strategy=strategy, world_size=world_size, status="skipped", reason=reason,
                        **kept)
    job_dir = workdir / f"{RowSpec(strategy, precision).label}-{world_size}"
    job_dir.mkdir(parents=True, exist_ok=True)
    spec_path = job_dir / "spec.json"
    config.job_spec(strategy, precision, accelerator).write(spec_path)
    out_dir = job_dir / "out"
    argv = bench_jobs.local_launch_argv(spec_path, out_dir, strategy=strategy,
                                        world_size=world_size)
    outcome = bench_jobs.run_local(argv, out_dir, env=bench_jobs.job_env(threads=config.threads),
                                   timeout=config.timeout_s)
    servers = bench_jobs.server_args(strategy)[0]
    if not outcome.ok:
        return BenchRow(strategy=strategy, world_size=world_size, status="failed",
                        reason=outcome.reason, num_processes=world_size + servers, **kept)
    # A layout row's strategy (and its resolved degrees) come back in the notice.
    return row_from_results(strategy, world_size, outcome.results, precision=precision,
                            epoch_samples=config.epoch_samples,
                            num_processes=world_size + servers,
                            note=f"+{servers} server(s)" if servers else "")


def bench(config: BenchConfig | None = None, *, log: Callable[[str], Any] | None = None,
          workdir: str | Path | None = None, **fields: Any) -> BenchReport:
    """Measure every strategy x world size of ``config`` (or ``BenchConfig(**fields)``).

    ``log`` receives one line per configuration (default: stderr). Per-job files
    (spec, per-rank JSON, launcher log) go to ``workdir`` (default: a temporary
    directory removed afterwards).
    """
    config = replace(config, **fields) if config is not None else BenchConfig(**fields)
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    accelerator = resolve_accelerator(config.accelerator)
    rows = resolve_rows(config.strategies, precisions=config.precisions, accelerator=accelerator)
    facts = check_model(config)
    settings = {**asdict(config), "strategies": [r.label for r in rows],
                "accelerator": accelerator,
                "title": f"paratrain bench: {config.model}, batch {config.batch_size}/process "
                         f"on {accelerator}"}
    report = BenchReport(settings=settings)
    with tempfile.TemporaryDirectory(prefix="paratrain-bench-") as tmp:
        root = Path(workdir) if workdir is not None else Path(tmp)
        for spec in rows:
            for n in config.world_sizes:
                row = run_one(config, spec.strategy, n, root, precision=spec.precision,
                              accelerator=accelerator, facts=facts)
                report.rows.append(row)
                what = (f"{row.samples_per_s:,.1f} samples/s" if row.ok
                        else f"{row.status}: {row.reason}")
                log(f"bench: {spec.label} x{n}: {what}")
    add_scaling_efficiency(report.rows, REFERENCE)
    return report


# --- command line -------------------------------------------------------------------
