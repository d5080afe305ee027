"""Helpers of ``plan_validation.py`` for token inputs and the tensor-parallel rows.

A ``tp`` job has no gradient-sync-free phase to calibrate from: its ranks exchange
activations inside every forward and backward, so the job's "compute" phase already
contains the communication being predicted. Its compute is the one-process calibration
scaled by how much slower one process computes while ``W`` of them share this machine,
read from the ``ddp`` job of the same run with the same workers and link (its sync-free
phase at the same per-rank batch). DTensor's dispatch, which ``calibrate`` cannot see,
is measured in one process on a fake process group (:func:`split_ratio`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
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


def cell_order(strategies: list[str], workers: list[int],
               links: list[str]) -> list[tuple[str, int, str]]:
    """``(strategy, workers, link)`` cells in the order to run them: strategy by strategy,
    except that with tensor-parallel rows each cell's ``ddp`` job runs right before
    them, so that its contention factor sees the same load on the shared machine."""
    if "ddp" not in strategies or not any(s in TENSOR_STRATEGIES for s in strategies):
        return [(s, w, link) for s in strategies for w in workers for link in links]
    paired = ["ddp", *(s for s in strategies if s in TENSOR_STRATEGIES)]
    cells = [(s, w, link) for w in workers for link in links for s in paired]
    return cells + [(s, w, link) for s in strategies if s not in paired
                    for w in workers for link in links]


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


def dispatch_time(base, ratio: float, tensor_degree: int, batch: int) -> float:
    """Seconds per step a rank computes beyond the split share of the whole model, from
    the measured :func:`split_ratio` at ``batch`` samples."""
    share = base.tp_split_fraction / tensor_degree + 1 - base.tp_split_fraction
    return max(0.0, ratio - share) * batch * base.compute_time_per_sample


def tensor_profile(base, factor: float, dispatch: float):
    """The one-process profile with ``dispatch`` seconds per step, its compute, dispatch
    and optimizer step slowed by ``factor``."""
    return replace(base, compute_time_per_sample=base.compute_time_per_sample * factor,
                   optimizer_step_time=base.optimizer_step_time * factor,
                   tp_dispatch_time=dispatch * factor)


def without_tensor_fields(profile):
    """``profile`` as a calibration without the ``tp_*`` fields saw it (the fallback)."""
    return replace(profile, tp_allreduces=0, tp_allreduce_bytes_per_sample=0.0,
                   tp_split_fraction=1.0, tp_split_param_fraction=1.0, tp_dispatch_time=0.0)


def split_ratio(args, tensor_degree: int) -> float:
    """One tensor rank's forward + backward over the whole model's, both timed in one
    fresh process on one thread, the split one on a fake process group (collectives are
    no-ops): the compute a rank really does, DTensor's dispatch included."""
    argv = [sys.executable, __file__, args.model, ",".join(map(str, args.input_shape)),
            str(args.vocab_size), str(args.batch_size), str(tensor_degree)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=args.timeout, check=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    return float(out.stdout.split()[-1])


def _time_split(model_name: str, shape: str, vocab: str, batch: str, degree: str) -> float:
    import torch.distributed as dist
    from paratrain.strategies.tensor.strategy import apply_tp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from paratrain.bench.worker import load_factory
    from paratrain.strategies.tensor.plan import automatic_plan

    torch.set_num_threads(1)
    args = argparse.Namespace(model=model_name, input_shape=tuple(map(int, shape.split(","))),
                              vocab_size=None if vocab == "None" else int(vocab))
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=int(degree))
    whole, split = load_factory(model_name)(), load_factory(model_name)()
    apply_tp(split, init_device_mesh("cpu", (int(degree),)), automatic_plan(split))
    example = example_batch(args, int(batch))
    with torch.no_grad():
        loss = make_loss(whole(example), int(batch), torch.Generator().manual_seed(0),
                         vocab_size=args.vocab_size)

    def once(model) -> float:
        t0 = time.perf_counter()
        loss(model(example)).backward()
        return time.perf_counter() - t0

    ratios = []
    for i in range(9):  # alternate, so that a change in load hits both alike
        a, b = once(whole), once(split)
        if i >= 2:
            ratios.append(b / a)
    dist.destroy_process_group()
    return statistics.median(ratios)


if __name__ == "__main__":
    print(_time_split(*sys.argv[1:6]))
