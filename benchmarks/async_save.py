"""Step-time cost of periodic checkpoints: none vs synchronous vs background saves.

    python benchmarks/async_save.py --steps 400 --repeats 3 --every 100 20

The demo's ConvNet (paratrain.models.convnet) with Adam trains on synthetic tensors
of Fashion-MNIST's shape through ``paratrain.Run`` (strategy ``single``, one
process). Each repeat runs every variant once, in a rotating order, so that drift
in machine load hits all alike; the table shows the median time per optimizer step
of the timed steps (saves included; the last background write, which ``close()``
waits for, is not), its ratio to the run without saves, and the median time one
``run.save()`` call keeps the training loop waiting (what ``checkpoint_every`` calls).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import paratrain
from paratrain.models import convnet


def timed_run(*, every: int | None, background: bool, steps: int, warmup: int,
              batch_size: int, accelerator: str,
              directory: str) -> tuple[float, list[float]]:
    """Seconds per optimizer step over ``steps`` steps after ``warmup`` untimed ones, and
    the seconds each save blocked the loop."""
    total = steps + warmup
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(total * batch_size, 1, 28, 28, generator=generator)
    labels = torch.randint(0, 10, (total * batch_size,), generator=generator)
    with paratrain.Run(strategy="single", accelerator=accelerator, progress=False, seed=0,
                       checkpoint_dir=directory, async_save=background, peak_flops=0) as run:
        model = convnet()
        model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
        loader = run.loader(TensorDataset(images, labels), batch_size=batch_size,
                            shuffle=False)
        start, blocked = 0.0, []
        for _ in run.epochs(1):
            for x, y in loader:
                if run.global_step == warmup:
                    if run.device.type == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
                if every and run.global_step > warmup and run.global_step % every == 0:
                    # What checkpoint_every does after the step, timed on its own.
                    began = time.perf_counter()
                    run.save()
                    blocked.append(time.perf_counter() - began)
            if run.device.type == "cuda":
                torch.cuda.synchronize()
        return (time.perf_counter() - start) / steps, blocked


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--every", type=int, nargs="+", default=[100, 20],
                        help="save every this many steps (one row pair per value)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--accelerator", default="auto")
    args = parser.parse_args()
    variants = [("no saves", None, False)]
    for every in args.every:
        variants += [(f"sync every {every}", every, False),
                     (f"background every {every}", every, True)]
    times: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    blocked: dict[str, list[float]] = {name: [] for name, _, _ in variants}
    for repeat in range(args.repeats):
        shift = repeat % len(variants)
        for name, every, background in variants[shift:] + variants[:shift]:
            with tempfile.TemporaryDirectory() as directory:
                step_s, saves = timed_run(every=every, background=background,
                                          steps=args.steps, warmup=args.warmup,
                                          batch_size=args.batch_size,
                                          accelerator=args.accelerator, directory=directory)
            times[name].append(step_s)
            blocked[name] += saves
            print(f"repeat {repeat}: {name:<22} {times[name][-1] * 1e3:8.2f} ms/step",
                  flush=True)
    base = statistics.median(times["no saves"])
    print()
    print(f"{'variant':<24} {'median ms/step':>15} {'min':>8} {'max':>8} {'vs no saves':>12} "
          f"{'ms blocked/save':>16}")
    for name, _, _ in variants:
        median = statistics.median(times[name])
        waits = f"{'-':>16}"
        if blocked[name]:
            waits = f"{statistics.median(blocked[name]) * 1e3:16.1f}"
        print(f"{name:<24} {median * 1e3:15.2f} {min(times[name]) * 1e3:8.2f} "
              f"{max(times[name]) * 1e3:8.2f} {median / base:12.3f} {waits}")
    for every in args.every:
        sync = statistics.median(times[f"sync every {every}"])
        background = statistics.median(times[f"background every {every}"])
        waits = {mode: statistics.median(blocked[f"{mode} every {every}"])
                 for mode in ("sync", "background")}
        print(f"every {every}: step-time cost sync {100 * (sync / base - 1):+.1f}%, "
              f"background {100 * (background / base - 1):+.1f}% measured; blocked time per "
              f"step sync {100 * waits['sync'] / every / base:.2f}%, background "
              f"{100 * waits['background'] / every / base:.2f}% of a no-save step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
