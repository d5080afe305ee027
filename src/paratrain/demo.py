"""``paratrain demo``: a ConvNet on Fashion-MNIST, written only with the public API.

It is also the reference example: the same script runs as one process or, under
``paratrain launch``, as many.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import torch
import torch.nn.functional as F

import paratrain
from paratrain.datasets.images import DatasetNotFound, fashion_mnist
from paratrain.distributed.device import peak_memory_bytes
from paratrain.models import convnet


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paratrain demo", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--nproc", type=int, default=2, help="worker processes (default 2)")
    add("--strategy", default="auto", help="auto, single, dp, ddp, ...")
    add("--epochs", type=int, default=5)
    add("--batch-size", type=int, default=64, help="per worker")
    add("--lr", type=float, default=1e-3)
    add("--precision", default="32")
    add("--accumulate", type=int, default=1)
    add("--train-samples", type=int, default=None, help="use only the first N training images")
    add("--test-samples", type=int, default=None, help="evaluate on the first N test images")
    add("--data-dir", default=None, help="folder with the Fashion-MNIST IDX files")
    add("--checkpoint-dir", default=None, help="save every epoch here and resume from it")
    add("--checkpoint-every", type=int, default=None, help="also save every N steps")
    add("--seed", type=int, default=0)
    add("--json", default=None, metavar="PATH", help="write a summary of the run here")
    add("--save-params", default=None, metavar="PATH", help="save final parameters (tests)")
    add("--no-progress", action="store_true")
    return parser


def train(args: argparse.Namespace) -> dict:
    """Train and evaluate; return the summary (on every rank)."""
    started = time.perf_counter()
    with paratrain.Run(
        strategy=args.strategy, precision=args.precision, accumulate=args.accumulate,
        seed=args.seed, checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every, progress=not args.no_progress,
    ) as run:
        train_set = fashion_mnist("train", data_dir=args.data_dir, limit=args.train_samples)
        test_set = fashion_mnist("test", data_dir=args.data_dir, limit=args.test_samples)
        model = convnet()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        model, optimizer = run.prepare(model, optimizer)
        loader = run.loader(train_set, batch_size=args.batch_size, shuffle=True)
        test_loader = run.eval_loader(test_set, batch_size=512)
        run.print(f"training on {run.world_size} process(es), strategy {run.strategy.name}, "
                  f"global batch {loader.global_batch_size}")
        result = {}
        for epoch in run.epochs(args.epochs):
            for x, y in run.progress(loader):
                loss = F.cross_entropy(model(x), y)
                run.backward(loss)
                run.step(optimizer)
            speed = run.epoch_throughput()["samples_per_s"]
            result = run.evaluate(model, test_loader)
            run.print(f"epoch {epoch}: train loss {run.mean(loss):.4f}  "
                      f"test accuracy {result['accuracy']:.4f}  {speed:,.0f} samples/s")
            if args.checkpoint_dir:
                run.save()
        if not result:  # resumed after the last epoch: evaluate the restored model
            result = run.evaluate(model, test_loader)
        peaks = run.gather(torch.tensor(peak_memory_bytes(run.device))).tolist()
        speeds = [s["samples_per_s"] for s in run.epoch_stats]
        summary = {
            "strategy": run.strategy.name,
            "world_size": run.world_size,
            "epochs": args.epochs,
            "test_accuracy": result["accuracy"],
            "test_loss": result["loss"],
            "samples_per_s": sum(speeds) / len(speeds) if speeds else 0.0,
            "wall_time_s": time.perf_counter() - started,
            "peak_memory_bytes_per_rank": peaks,
        }
        if run.is_main and args.save_params:
            torch.save(run.strategy.unwrap(model).state_dict(), args.save_params)
        if run.is_main and args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        run.print(f"final test accuracy {result['accuracy']:.4f}, "
                  f"wall time {summary['wall_time_s']:.1f} s")
        return summary


def main(argv: Sequence[str] | None = None) -> int:
    """``paratrain demo``: relaunch through ``paratrain launch`` unless already launched."""
    args = build_parser().parse_args(argv)
    if args.nproc < 1:
        print(f"paratrain demo: --nproc must be >= 1, got {args.nproc}", file=sys.stderr)
        return 2
    try:
        fashion_mnist_dir = paratrain.datasets.find_fashion_mnist(args.data_dir)
    except DatasetNotFound as exc:
        print(f"paratrain demo: {exc}", file=sys.stderr)
        return 2
    launched = "RANK" in os.environ or args.nproc == 1
    if launched:
        args.data_dir = str(fashion_mnist_dir)
        train(args)
        return 0
    from paratrain.launch import launcher as launch

    forwarded = list(argv if argv is not None else sys.argv[1:])
    return launch.main(["--nproc-per-node", str(args.nproc), "-m", "paratrain.demo", *forwarded])


if __name__ == "__main__":
    sys.exit(main())
