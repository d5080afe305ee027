"""Input path: DataLoader (per-sample fetch + collate) vs batched gather, side by side.

    python benchmarks/input_path.py --repeats 5

Both loaders come from ``run.loader`` over Fashion-MNIST's training set
(``batched=False`` forces the DataLoader path). Each repeat times, for both paths in
alternating order: iterating one whole epoch (input only), and ``--steps`` training
steps of the demo's ConvNet (input + forward + backward + Adam). Prints the samples/s
of every repeat, the medians and the median paired ratio batched/DataLoader.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import paratrain
from paratrain.datasets import fashion_mnist
from paratrain.models import convnet

PATHS = ("dataloader", "batched")


def epoch_speed(loader, epoch: int) -> float:
    loader.set_epoch(epoch)
    started, samples = time.perf_counter(), 0
    for x, _ in loader:
        samples += len(x)
    if x.is_cuda:
        torch.cuda.synchronize()
    return samples / (time.perf_counter() - started)


def train_speed(run, model, optimizer, loader, epoch: int, steps: int) -> float:
    loader.set_epoch(epoch)
    batches = iter(loader)
    x, y = next(batches)  # the first batch (and the first step) are warm-up
    samples = 0
    for step in range(steps + 1):
        if step == 1:
            if x.is_cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        run.backward(loss)
        run.step(optimizer)
        samples += len(x) if step else 0
        x, y = next(batches)
    if x.is_cuda:
        torch.cuda.synchronize()
    return samples / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="timed training steps per repeat")
    parser.add_argument("--accelerator", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    run = paratrain.Run(strategy="single", accelerator=args.accelerator, progress=False, seed=0)
    model = convnet()
    model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    train_set = fashion_mnist("train", data_dir=args.data_dir)
    loaders = {path: run.loader(train_set, batch_size=args.batch_size, batched=path == "batched")
               for path in PATHS}
    print(f"{len(train_set)} samples, batch {args.batch_size}, {run.device}, "
          f"{torch.get_num_threads()} threads; loaders: "
          + ", ".join(f"{p} -> {type(v).__name__}" for p, v in loaders.items()))
    speeds: dict[str, dict[str, list[float]]] = {m: {p: [] for p in PATHS}
                                                 for m in ("epoch", "train")}
    for repeat in range(args.repeats):
        order = PATHS if repeat % 2 == 0 else PATHS[::-1]
        for path in order:
            speeds["epoch"][path].append(epoch_speed(loaders[path], repeat))
            speeds["train"][path].append(
                train_speed(run, model, optimizer, loaders[path], repeat, args.steps))
        print(f"repeat {repeat}: " + "  ".join(
            f"{m} {p} {speeds[m][p][-1]:9.0f}" for m in speeds for p in PATHS), flush=True)
    print()
    print(f"{'measure':<8} {'DataLoader samples/s':>21} {'batched samples/s':>18} "
          f"{'ratio (median of pairs)':>24}")
    for measure, by_path in speeds.items():
        ratios = [b / d for b, d in zip(by_path["batched"], by_path["dataloader"])]
        print(f"{measure:<8} {statistics.median(by_path['dataloader']):21.0f} "
              f"{statistics.median(by_path['batched']):18.0f} "
              f"{statistics.median(ratios):17.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    run.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
