"""Helpers of ``plan_validation.py`` for token inputs and the tensor-parallel rows.

A ``tp`` job has no gradient-sync-free phase to calibrate from: its ranks exchange
activations inside every forward and backward, so the job's "compute" phase already
contains the communication being predicted. Its compute is the one-process calibration
scaled by how much slower one process computes while ``W`` of them share this machine,
read from the ``ddp`` job of the same run with the same workers and link (its sync-free
phase at the same per-rank batch).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

import torch

from paratrain.bench.worker import JobSpec, make_batch, make_loss
from paratrain.plan import calibrate

#: Strategies predicted from the one-process calibration and ddp's contention factor.
TENSOR_STRATEGIES = ("tp", "fsdp_tp")


def example_batch(args, batch: int) -> torch.Tensor:
    """One batch as the bench worker builds it (floats, or tokens with ``--vocab-size``)."""
    spec = JobSpec(strategy="single", model=args.model, input_shape=args.input_shape,
                   batch_size=batch, vocab_size=args.vocab_size)
    return make_batch(spec, torch.Generator().manual_seed(0))


def calibrate_at(model, args, batch: int, *, optimizer: str | None = None):
    """``model`` calibrated on one CPU process at ``batch`` samples, with the job's loss."""
    example = example_batch(args, batch)
    with torch.no_grad():
        loss = make_loss(model(example), batch, torch.Generator().manual_seed(0),
                         vocab_size=args.vocab_size)
    return calibrate(model, example, loss, repeats=5, device="cpu", optimizer=optimizer)


def order_strategies(strategies: list[str]) -> list[str]:
    """``ddp`` first when tensor-parallel rows need its contention factor."""
    if "ddp" in strategies and any(s in TENSOR_STRATEGIES for s in strategies):
        return ["ddp", *(s for s in strategies if s != "ddp")]
    return strategies


def in_situ_compute(first: dict) -> float:
    """Seconds of one rank's forward + backward + optimizer step inside the running job."""
    return statistics.median(first["compute_step_s"]) + first["optimizer_step_s"]


def contention(base, ddp_first: dict | None) -> float:
    """How much slower one process computes inside the ``ddp`` job than alone (1.0
    without a ddp job)."""
    if ddp_first is None:
        return 1.0
    alone = ddp_first["batch_size"] * base.compute_time_per_sample + base.optimizer_step_time
    return in_situ_compute(ddp_first) / alone


def tensor_profile(base, factor: float):
    """The one-process profile with its compute and optimizer step slowed by ``factor``."""
    return replace(base, compute_time_per_sample=base.compute_time_per_sample * factor,
                   optimizer_step_time=base.optimizer_step_time * factor)


def without_tensor_fields(profile):
    """``profile`` as a calibration without the ``tp_*`` fields saw it (the fallback)."""
    return replace(profile, tp_allreduces=0, tp_allreduce_bytes_per_sample=0.0,
                   tp_split_fraction=1.0, tp_split_param_fraction=1.0)
