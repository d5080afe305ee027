"""What naming stragglers costs, and whether a 1.5x slow rank is named within 3 checks.

    python benchmarks/straggler_cost.py --repeats 3 --steps 300 --slow-steps 200 \
        --slow-runs 3 --clean-runs 20

The demo's training (ConvNet, Adam, batch 64 per rank of 28x28 images, DDP over gloo,
two ranks, one thread each) on random images of Fashion-MNIST's shape, three ways:

- **cost**: the same run with ``stragglers=False`` and with the default
  (``check_every=50``), side by side, the order alternating each repeat. Printed: the
  mean step on rank 0 (a mean, not a median, so the step with a check counts) and the
  ratio; and the detector's own time measured inside the run (its forward wrapper, its
  after-step hook and the checks' all-gathers) as a share of the step, which is the
  figure below the noise of two loaded cores.
- **slow**: ``--slow-runs`` runs where rank 1's forward takes 1.5x as long (after its
  real forward it sleeps half of the time that forward took): at which check it is
  named, each check's ratio, and the line.
- **clean**: ``--clean-runs`` runs of the default detector with no slow rank: the
  lines printed (each one a false alarm).

The loader times its wait in both variants (two clock reads per batch), so that part of
the cost is in neither; :mod:`paratrain.reliability.stragglers` explains the method.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import paratrain
from paratrain.distributed.spawn import spawn
from paratrain.models import convnet


class _Slower(torch.nn.Module):
    """``inner``, whose forward takes ``factor`` times as long (a sleep after it)."""

    def __init__(self, inner: torch.nn.Module, factor: float) -> None:
        super().__init__()
        self.inner, self.factor = inner, factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner(x)
        if self.factor > 1:
            time.sleep((self.factor - 1) * (time.perf_counter() - start))
        return out


def _timed(owner: object, name: str, spent: list[float]) -> None:
    """Wrap ``owner.name`` so that the seconds spent in it add up in ``spent[0]``."""
    inner = getattr(owner, name)

    def call(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start

    setattr(owner, name, call)


def _worker(rank: int, world_size: int, stragglers: object, steps: int, warmup: int,
            batch: int, slow_rank: int, factor: float) -> dict:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    n = (steps + warmup) * batch * world_size
    data = TensorDataset(torch.randn(n, 1, 28, 28, generator=g),
                         torch.randint(0, 10, (n,), generator=g))
    spent = [0.0]
    with paratrain.Run(strategy="ddp", stragglers=stragglers, progress=False) as run:
        detector = run._stragglers
        ratios: list[float] = []  # each check's max/median ratio
        if detector.options is not None:  # the detector's own time, on this rank
            _timed(detector, "after_step", spent)
            log = detector.log
            detector.log = lambda row, step: (ratios.append(row["straggler_ratio"]),
                                              log(row, step=step))
        model = _Slower(convnet(), factor if rank == slow_rank else 1.0)
        model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
        loader = run.loader(data, batch_size=batch, shuffle=False)
        times, named_at = [], None
        for _ in run.epochs(1):
            start = time.perf_counter()
            for index, (x, y) in enumerate(loader):
                loss = F.cross_entropy(model(x), y)
                run.backward(loss)
                run.step(optimizer)
                end = time.perf_counter()
                if index >= warmup:
                    times.append(end - start)
                start = end
                if named_at is None and detector.reports:
                    named_at = detector.checks
        return {"times": times, "reports": detector.reports, "named_at": named_at,
                "checks": detector.checks, "spent": spent[0], "ratios": ratios}


def wrapper_cost(calls: int = 200_000) -> float:
    """Seconds the detector's forward wrapper adds to one call (a no-op module, CPU)."""
    from paratrain.reliability.stragglers import StragglerDetector, Stragglers

    def per_call(module: torch.nn.Module) -> float:
        x = torch.ones(1)
        best = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(calls):
                module.forward(x)
            best = min(best, (time.perf_counter() - start) / calls)
        return best

    bare, watched = torch.nn.Identity(), torch.nn.Identity()
    StragglerDetector(Stragglers(), gather=None, host=None, device=torch.device("cpu"),
                      print_fn=None, log=None).watch(watched)
    with torch.enable_grad():
        return per_call(watched) - per_call(bare)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--nproc", type=int, default=2)
    add("--repeats", type=int, default=3)
    add("--steps", type=int, default=300, help="timed steps per cost run")
    add("--warmup", type=int, default=10)
    add("--batch", type=int, default=64)
    add("--slowdown", type=float, default=1.5, help="the slow rank's forward, x (slow run)")
    add("--slow-steps", type=int, default=200)
    add("--slow-runs", type=int, default=3)
    add("--clean-runs", type=int, default=20)
    args = parser.parse_args()

    def run(stragglers: object, steps: int, factor: float = 1.0) -> list[dict]:
        return spawn(_worker, args.nproc, stragglers, steps, args.warmup, args.batch, 1,
                     factor, timeout=1800)

    print(f"{args.nproc} ranks (ddp, gloo, 1 thread each), batch {args.batch} per rank, "
          f"load average {os.getloadavg()[0]:.1f}")
    means: dict[str, list[float]] = {"off": [], "on": []}
    own: list[float] = []
    for repeat in range(args.repeats):
        for name in (("off", "on") if repeat % 2 == 0 else ("on", "off")):
            results = run(name == "on", args.steps)
            means[name].append(statistics.mean(results[0]["times"]))
            if name == "on":
                own.append(results[0]["spent"] / (args.steps + args.warmup))
    step = statistics.median(means["off"])
    print("| variant | mean step, rank 0 (ms), per repeat | median | ratio to off |")
    print("| --- | --- | --- | --- |")
    for key, name in (("off", "stragglers=False"), ("on", "stragglers=True (every 50)")):
        value = statistics.median(means[key])
        print(f"| {name} | {', '.join(f'{1e3 * m:.2f}' for m in means[key])} | "
              f"{1e3 * value:.2f} | {value / step:.4f} |")
    hook, wrapper = statistics.median(own), wrapper_cost()
    spent = hook + wrapper
    print(f"the detector's own time on rank 0: after-step hook with the checks "
          f"{1e6 * hook:.1f} us + forward wrapper {1e6 * wrapper:.2f} us = {1e6 * spent:.1f} us "
          f"per step, {100 * spent / step:.3f}% of the {1e3 * step:.2f} ms step")

    for _ in range(args.slow_runs):
        results = run(True, args.slow_steps, args.slowdown)
        print(f"rank 1's forward {args.slowdown}x: named at check {results[0]['named_at']} of "
              f"{results[0]['checks']} (every 50 steps); the checks' ratios "
              f"{', '.join(f'{r:.2f}' for r in results[0]['ratios'])}")
        for line in results[0]["reports"]:
            print(f"  {line}")
    alarms, highest = 0, 0.0
    for _ in range(args.clean_runs):
        results = run(True, args.slow_steps)
        alarms += len(results[0]["reports"])
        highest = max(highest, *results[0]["ratios"])
        for line in results[0]["reports"]:
            print(f"  false alarm: {line}")
    if args.clean_runs:
        print(f"clean runs: {args.clean_runs} x {args.slow_steps + args.warmup} steps "
              f"({(args.slow_steps + args.warmup) // 50} checks each), false alarms: {alarms}, "
              f"highest check ratio {highest:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
