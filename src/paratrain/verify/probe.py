"""The probe behind ``paratrain verify``: k training steps of a setup under one factorization.

A factorization splits one global batch as ``world_size x micro_batch x
accumulate``. The probe trains the user's setup (model, data, loader and
training step) for k optimizer steps through :class:`paratrain.Run`, exactly as
a training script would, and records the synchronised gradients at every step,
the final parameters, and a fingerprint of every sample each rank consumed.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from paratrain.config import PRECISIONS
from paratrain.distributed.dtensor import whole
from paratrain.run.core import Run
from paratrain.strategies.capabilities import local_module

VARIANT_FLAGS = ("frozen-batchnorm", "no-dropout")
"""Diagnostic changes to the model: BatchNorm uses running statistics, dropout is off."""


@dataclass(frozen=True)
class Factorization:
    """One way to make the global batch: ``world_size x micro_batch x accumulate``."""

    world_size: int
    micro_batch: int
    accumulate: int

    def __post_init__(self) -> None:
        for name in ("world_size", "micro_batch", "accumulate"):
            if getattr(self, name) < 1:
                raise ValueError(f"factorization {name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def parse(cls, text: str) -> Factorization:
        """``"2x4x1"`` -> world size 2, micro-batch 4, accumulate 1."""
        match = re.fullmatch(r"\s*(\d+)x(\d+)x(\d+)\s*", text)
        if not match:
            raise ValueError(
                f"factorization {text!r} is not WORLDxMICROxACCUM, e.g. 2x4x1 "
                "(2 processes, micro-batch 4, no accumulation)"
            )
        return cls(*(int(part) for part in match.groups()))

    @property
    def global_batch(self) -> int:
        return self.world_size * self.micro_batch * self.accumulate

    @property
    def label(self) -> str:
        return f"{self.world_size}x{self.micro_batch}x{self.accumulate}"


def default_loader(run: Run, dataset: Dataset, micro_batch: int) -> Iterable[Any]:
    """The loader a paratrain script uses: shared seed, resharded and reseeded each epoch."""
    return run.loader(dataset, batch_size=micro_batch, shuffle=True)


def classification_step(run: Run, model: nn.Module, batch: Any) -> None:
    """Forward and backward of one micro-batch ``(x, y)`` with mean cross-entropy."""
    x, y = batch
    run.backward(F.cross_entropy(model(x), y))


def demo_model() -> nn.Module:
    """The demo's ConvNet."""
    from paratrain.models import convnet

    return convnet()


@functools.lru_cache(maxsize=1)
def demo_data() -> Dataset:
    """64 Fashion-MNIST training images (the probe needs only a few batches)."""
    # Cached: decoding the IDX file costs more than a probe, and probes only read it.
    from paratrain.datasets.images import fashion_mnist

    return fashion_mnist("train", limit=64)


@dataclass(frozen=True, kw_only=True)
class ProbeSetup:
    """The setup ``verify`` checks: the pieces of a training script, as factories.

    For multi-process factorizations the factories are sent to child processes,
    so they must be module-level functions (not lambdas or closures).
    """

    model_fn: Callable[[], nn.Module] = demo_model
    """Builds the model (called after seeding, identically on every rank)."""

    data_fn: Callable[[], Dataset] = demo_data
    """Builds the training dataset."""

    loader_fn: Callable[[Run, Dataset, int], Iterable[Any]] = default_loader
    """``loader_fn(run, dataset, micro_batch)``: the per-rank iterable of micro-batches."""

    step_fn: Callable[[Run, nn.Module, Any], None] = classification_step
    """``step_fn(run, model, batch)``: forward and ``run.backward`` of one micro-batch."""

    num_steps: int = 3
    """Optimizer steps per probe (they may run over several epochs)."""

    lr: float = 0.05
    """Learning rate of the probe's plain SGD, which turns gradients into parameter changes."""

    seed: int = 0
    precision: str = "32"
    strategy: str = "ddp"
    """Strategy for factorizations with more than one process."""

    strategy_options: dict[str, Any] = field(default_factory=dict)
    """Its options (``Run(strategy_options=...)``), e.g. ``{"split_points": (2,)}``."""

    accelerator: str = "auto"
    """``auto`` (CUDA when enough devices are visible, see :func:`resolve_accelerator`),
    ``cpu`` or ``cuda``."""

    timeout_s: float = 120.0
    """Limit for each multi-process probe."""

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")
        if self.accelerator not in ("auto", "cpu", "cuda"):
            raise ValueError(f"accelerator must be 'auto', 'cpu' or 'cuda', got {self.accelerator!r}")
        from paratrain.strategies import strategy_class

        options_class = strategy_class(self.strategy).Options  # ValueError naming the choices
        if not isinstance(self.strategy_options, dict):
            raise ValueError(f"strategy_options must be a dict, got {self.strategy_options!r}")
        unknown = sorted(set(self.strategy_options) - {f.name for f in fields(options_class)})
        if unknown:
            raise ValueError(f"strategy_options has unknown field(s) {unknown} for strategy "
                             f"{self.strategy!r}")
        options_class(**self.strategy_options)  # their own checks, before any process starts
        for name in ("model_fn", "data_fn", "loader_fn", "step_fn"):
            if not callable(getattr(self, name)):
                raise ValueError(f"{name} must be callable, got {getattr(self, name)!r}")


def resolve_accelerator(requested: str, factorizations: Iterable[Factorization], *,
                        num_gpus: int | None = None) -> str:
    """``cpu`` or ``cuda`` for every probe of ``factorizations``.

    Each process of a probe needs a GPU of its own (NCCL refuses two ranks on one device),
    so ``auto`` picks CUDA when a device is visible and there are as many as the largest
    world size, else the CPU; ``cuda`` without enough devices is a ValueError.
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"accelerator must be 'auto', 'cpu' or 'cuda', got {requested!r}")
    if requested == "cpu":
        return "cpu"
    largest = max((f for f in factorizations), key=lambda f: f.world_size)
    visible = num_gpus if num_gpus is not None else (
        torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if visible >= largest.world_size:
        return "cuda"
    if requested == "auto":
        return "cpu"
    raise ValueError(f"accelerator 'cuda': factorization {largest.label} needs "
                     f"{largest.world_size} GPUs (one per process), {visible} visible; use "
                     "--accelerator cpu or factorizations with fewer processes")


def model_traits(model: nn.Module) -> dict[str, bool]:
    """Which batch- or RNG-dependent layers the model has (decides the diagnostic variants)."""
    return {
        "batchnorm": any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules()),
        "dropout": any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
                       for m in model.modules()),
    }


def _apply_variant(model: nn.Module, variant: frozenset[str]) -> None:
    for module in model.modules():
        if "frozen-batchnorm" in variant and isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.eval()  # normalise with running statistics, not the micro-batch's
        if "no-dropout" in variant and isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0


def fingerprint(batch: Any) -> torch.Tensor:
    """One float64 per sample, from every tensor in the batch with the batch's first dimension."""
    leaves: list[torch.Tensor] = []

    def collect(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            leaves.append(value)
        elif isinstance(value, dict):
            for key in sorted(value):
                collect(value[key])
        elif isinstance(value, (list, tuple)):
            for item in value:
                collect(item)

    collect(batch)
    if not leaves or leaves[0].dim() == 0:
        return torch.zeros(0, dtype=torch.float64)
    size = leaves[0].shape[0]
    total = torch.zeros(size, dtype=torch.float64)
    for index, leaf in enumerate(leaf for leaf in leaves if leaf.dim() and leaf.shape[0] == size):
        flat = leaf.detach().reshape(size, -1).to("cpu", torch.float64)
        generator = torch.Generator().manual_seed(1000 + index)
        total += flat @ torch.randn(flat.shape[1], dtype=torch.float64, generator=generator)
    return total


def run_probe(setup: ProbeSetup, factorization: Factorization, variant: frozenset[str], *,
              environ: dict[str, str] | None = None) -> dict[str, Any]:
    """Train ``setup`` for ``num_steps`` optimizer steps under ``factorization``.

    Returns the sample fingerprints per step, the rank's data-parallel rank, and the names,
    gradients seen by the optimizer at each step and final parameters of the parameters
    the rank holds, as whole plain tensors.
    """
    one = factorization.world_size == 1
    run = Run(strategy="single" if one else setup.strategy,
              strategy_options={} if one else dict(setup.strategy_options),
              accumulate=factorization.accumulate, seed=setup.seed, precision=setup.precision,
              accelerator=setup.accelerator, progress=False, environ=environ,
              nan="warn")  # a probe observes: a NaN micro-batch mean is what it may report
    try:
        if run.world_size != factorization.world_size:
            raise ValueError(f"probe {factorization.label} started with {run.world_size} processes")
        model = setup.model_fn()
        _apply_variant(model, variant)
        optimizer = torch.optim.SGD(model.parameters(), lr=setup.lr)
        model, optimizer = run.prepare(model, optimizer)
        # local_module: a pipeline stage's parameters under their names in the whole model.
        params = list(local_module(run.strategy, model).named_parameters())
        grads: list[list[torch.Tensor]] = []
        # Every rank records: whole() gathers a sharded (fsdp, zero2) or tensor-parallel
        # gradient, a collective its peers join; a pipeline rank holds its stage's only.
        optimizer.register_step_pre_hook(lambda *_: grads.append(
            [_whole_cpu(p.grad) if p.grad is not None else torch.zeros(p.shape)
             for _, p in params]))
        # The global batch is the factorization's: ranks that read one batch together
        # (pipeline stages, tensor-parallel peers) read their peers' share too.
        readers = run.strategy.data_parallel_size
        micro_batch = factorization.micro_batch * factorization.world_size // readers
        loader = setup.loader_fn(run, setup.data_fn(), micro_batch)
        seen: dict[int, list[torch.Tensor]] = {}
        for _ in run.epochs(10**9):
            num_batches = 0
            for batch in loader:
                num_batches += 1
                seen.setdefault(run.global_step, []).append(fingerprint(batch))
                setup.step_fn(run, model, batch)
                run.step(optimizer)
                if run.global_step >= setup.num_steps:
                    break
            if run.global_step >= setup.num_steps:
                break
            if num_batches == 0:
                raise ValueError("the probe's loader yielded no batches; give verify more data")
        return {"samples": {step: torch.cat(parts) for step, parts in seen.items()},
                # Ranks that read the same batch (tensor-parallel peers, pipeline stages)
                # share a data-parallel rank: their samples count once.
                "data_rank": run.strategy.data_parallel_rank,
                "names": [name for name, _ in params], "grads": grads,
                "params": [_whole_cpu(p) for _, p in params]}
    finally:
        run.close()


def _whole_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A plain CPU copy of a parameter or gradient, gathered whole when it is a DTensor."""
    return whole(tensor.detach()).cpu().clone()


def probe_worker(rank: int, world_size: int, setup: ProbeSetup,
                 jobs: list[tuple[Factorization, frozenset[str]]]) -> list[dict[str, Any]]:
    """Entry point of each rank: every probe of this world size under one process group."""
    from paratrain.distributed.process_group import init_process_group
    from paratrain.distributed.topology import Topology

    # One group for all probes; each Run reuses it rather than creating its own.
    init_process_group(Topology.from_env(accelerator=setup.accelerator),
                       timeout_s=setup.timeout_s)
    return [run_probe(setup, factorization, variant) for factorization, variant in jobs]
