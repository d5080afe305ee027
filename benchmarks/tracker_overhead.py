"""Tracker overhead per step: no trackers vs TensorBoard vs MLflow vs W&B offline.

    python benchmarks/tracker_overhead.py --repeats 3 --steps 60

The demo's step (ConvNet, Adam, batch 64 of 28x28 images, one process) with
``run.log({"loss": loss})`` at every step, for each variant in turn (the order rotates
each repeat, so drift in machine load hits all alike). Two numbers per variant:

- the median step time, end to end (includes the trackers' background threads
  competing for the CPU), and its ratio to the run without trackers;
- the time ``run.log`` takes on the training thread (what a tracker adds to the step
  itself; the client's work happens on the tracker's own thread).

MLflow uses its embedded SQLite store, W&B ``WANDB_MODE=offline``, both under a
temporary directory. Needs ``pip install 'paratrain[trackers]'``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import paratrain
from paratrain.models import convnet

VARIANTS = {"none": [], "tensorboard": ["tensorboard"], "mlflow": ["mlflow"],
            "wandb offline": ["wandb"]}


def one_run(loggers: list[str], directory: Path, *, steps: int, warmup: int,
            batch: int) -> tuple[list[float], list[float], float]:
    """Step times and ``run.log`` times (seconds) of the timed steps, and the process's
    CPU seconds per timed step (all its threads: the trackers' included)."""
    g = torch.Generator().manual_seed(0)
    n = (steps + warmup) * batch
    data = TensorDataset(torch.randn(n, 1, 28, 28, generator=g),
                         torch.randint(0, 10, (n,), generator=g))
    step_times, log_times = [], []
    with paratrain.Run(accelerator="cpu", progress=False, loggers=loggers,
                       checkpoint_dir=str(directory)) as run:
        model = convnet()
        model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
        loader = run.loader(data, batch_size=batch, shuffle=False)
        for _ in run.epochs(1):
            start, cpu = time.perf_counter(), 0.0
            for index, (x, y) in enumerate(loader):
                loss = F.cross_entropy(model(x), y)
                run.backward(loss)
                run.step(optimizer)
                before = time.perf_counter()
                run.log({"loss": loss})
                end = time.perf_counter()
                if index == warmup:
                    cpu = time.process_time()
                if index >= warmup:  # the first steps start the trackers' clients
                    step_times.append(end - start)
                    log_times.append(end - before)
                start = end
            cpu = time.process_time() - cpu
    return step_times, log_times, cpu / max(1, len(step_times))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    steps: dict[str, list[float]] = {name: [] for name in VARIANTS}
    logs: dict[str, list[float]] = {name: [] for name in VARIANTS}
    cpus: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = names[repeat % len(names):] + names[:repeat % len(names)]
            for name in order:
                s, g, c = one_run(VARIANTS[name], Path(tmp) / f"{repeat}-{name.split()[0]}",
                               steps=args.steps, warmup=args.warmup, batch=args.batch)
                steps[name] += s
                logs[name] += g
                cpus[name].append(c)
    base = statistics.median(steps["none"])
    print(f"{args.repeats} repeats x {args.steps} timed steps, batch {args.batch}, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("| variant | median step (ms) | ratio to none | CPU per step, all threads (ms) | "
          "run.log on the training thread (us, median) | share of the step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        step, log = statistics.median(steps[name]), statistics.median(logs[name])
        print(f"| {name} | {1e3 * step:.1f} | {step / base:.3f} | "
              f"{1e3 * statistics.median(cpus[name]):.1f} | {1e6 * log:.0f} | "
              f"{100 * log / base:.3f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
