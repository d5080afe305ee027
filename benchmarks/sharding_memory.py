"""Per-rank memory of DDP, FSDP and pipeline at N = 1, 2, 4.

For each strategy and N (gloo, CPU processes) a stack of Linear blocks is
trained for a few Adam steps; each rank reports the bytes it holds in
parameters, gradients and optimizer state, and its peak resident memory
above the baseline taken before the model was built. The pipeline bubble has its own
benchmark, ``pipeline_bubble.py``.

    python benchmarks/sharding_memory.py                   # full size
    python benchmarks/sharding_memory.py --width 256 --sizes 1,2   # quick
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from memory_probe import local_bytes, max_rss, mlp, optimizer_state_bytes
from torch.utils.data import TensorDataset

import paratrain
from paratrain.distributed.spawn import spawn

STRATEGIES = ("ddp", "fsdp", "pipeline")


def memory_worker(rank, world_size, strategy, width, depth, batch_size, num_steps):
    torch.set_num_threads(1)
    run = paratrain.Run(strategy=strategy if world_size > 1 else "single", progress=False,
                        accelerator="cpu", seed=0)
    baseline = max_rss()
    model = mlp(width, depth)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = run.prepare(model, optimizer)
    data = TensorDataset(torch.randn(batch_size * 64, width), torch.randint(0, 10, (batch_size * 64,)))
    loader = run.loader(data, batch_size=batch_size)
    grads = 0
    for _ in run.epochs(1):
        for step, (x, y) in enumerate(loader):
            if step == num_steps:
                break
            run.backward(F.cross_entropy(model(x), y))
            grads = local_bytes(p.grad for p in model.parameters())
            run.step(optimizer)
    params = local_bytes(model.parameters())
    state = optimizer_state_bytes(optimizer)
    peak = max_rss() - baseline
    run.close()
    return {"params": params, "grads": grads, "optimizer": state, "peak": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=32, help="per data-parallel rank")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sizes", default="1,2,4")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    mib = 2**20
    print(f"model: {args.depth} x Linear({args.width}, {args.width}) + head, Adam, float32")
    print(f"{'strategy':<9} {'N':>2} {'params MiB':>11} {'grads MiB':>10} {'optim MiB':>10} "
          f"{'state MiB':>10} {'vs DDP':>7} {'peak MiB':>9}")
    ddp_state: dict[int, int] = {}
    for n in sizes:
        for strategy in STRATEGIES:
            results = spawn(memory_worker, n, strategy, args.width, args.depth,
                            args.batch_size, args.steps, timeout=900)
            worst = max(results, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
            state = worst["params"] + worst["grads"] + worst["optimizer"]
            if strategy == "ddp":
                ddp_state[n] = state
            ratio = state / ddp_state[n] if n in ddp_state else float("nan")
            print(f"{strategy:<9} {n:>2} {worst['params'] / mib:>11.2f} {worst['grads'] / mib:>10.2f} "
                  f"{worst['optimizer'] / mib:>10.2f} {state / mib:>10.2f} {ratio:>7.3f} "
                  f"{max(r['peak'] for r in results) / mib:>9.1f}")


if __name__ == "__main__":
    main()
