"""One training job for benchmarks/overhead.py: paratrain DDP or a hand-written DDP loop.

Both variants train the demo ConvNet on the same Fashion-MNIST subset with the
same global batch and optimizer; each times its last epoch between barriers
(the earlier epochs are warm-up) and rank 0 writes samples/s to --json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.datasets.images import fashion_mnist
from paratrain.models import convnet


def timed_epoch(run_epoch) -> float:
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    run_epoch()
    if dist.is_initialized():
        dist.barrier()
    return time.perf_counter() - start


def paratrain_variant(args, data) -> float:
    import paratrain

    with paratrain.Run(strategy="ddp", seed=0) as run:
        model = convnet()
        model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
        loader = run.loader(data, batch_size=args.batch_size)
        seconds = 0.0
        for _ in run.epochs(args.epochs):
            def one_epoch():
                for x, y in run.progress(loader):
                    loss = F.cross_entropy(model(x), y)
                    run.backward(loss)
                    run.step(optimizer)
            seconds = timed_epoch(one_epoch)
        return seconds


def raw_variant(args, data) -> float:
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(convnet())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    seconds = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)

        def one_epoch():
            for x, y in loader:
                optimizer.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
        seconds = timed_epoch(one_epoch)
    model = None  # release the DDP reducer before the process group
    dist.destroy_process_group()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=["paratrain", "raw"], required=True)
    parser.add_argument("--samples", type=int, default=12_800)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--json", required=True)
    args = parser.parse_args()
    data = fashion_mnist("train", limit=args.samples)
    run = paratrain_variant if args.variant == "paratrain" else raw_variant
    seconds = run(args, data)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(args.json, "w") as f:
            json.dump({"variant": args.variant, "seconds": seconds,
                       "samples_per_s": args.samples / seconds}, f)


if __name__ == "__main__":
    main()
