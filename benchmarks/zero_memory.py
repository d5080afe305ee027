"""Per-rank memory and step time of ddp, zero1, zero2 and fsdp, side by side.

Two gloo CPU ranks train a stack of Linear blocks (about 25M parameters by default)
with Adam. Each rank reports the bytes it holds in parameters (at rest, between
steps, and between forward and backward), gradients (right after backward) and Adam's state, its peak resident
memory above the baseline taken before the model was built, and the median time
of one optimizer step (forward, backward, step) after two warm-up steps.

    python benchmarks/zero_memory.py                              # ~25M parameters
    python benchmarks/zero_memory.py --width 256 --depth 2 --steps 3  # quick
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from memory_probe import local_bytes, max_rss, mlp, optimizer_state_bytes

import paratrain
from paratrain.distributed.spawn import spawn

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
WARMUP = 2





def memory_worker(rank, world_size, strategy, width, depth, batch_size, num_steps):
    torch.set_num_threads(1)
    run = paratrain.Run(strategy=strategy, progress=False, accelerator="cpu", seed=0)
    baseline = max_rss()
    model = mlp(width, depth)
    model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    x, y = torch.randn(batch_size, width), torch.randint(0, 10, (batch_size,))
    grads, held, times = 0, 0, []
    for _ in range(WARMUP + num_steps):
        run.strategy.barrier()
        start = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        # Between forward and backward: whole under zero2, one block at a time under fsdp.
        held = local_bytes(model.parameters())
        run.backward(loss)
        grads = local_bytes(p.grad for p in model.parameters())
        run.step(optimizer)
        run.strategy.barrier()
        times.append(time.perf_counter() - start)
    # zero1's ZeroRedundancyOptimizer keeps this rank's state in its local optimizer.
    local = getattr(optimizer, "optim", optimizer)
    state = optimizer_state_bytes(local)
    result = {"params": local_bytes(model.parameters()), "held": held, "grads": grads, "optimizer": state,
              "peak": max_rss() - baseline, "step": statistics.median(times[WARMUP:])}
    run.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the warm-up")
    args = parser.parse_args()
    mib = 2**20
    numel = sum(p.numel() for p in mlp(args.width, args.depth).parameters())
    print(f"model: {args.depth} x Linear({args.width}, {args.width}) + head = "
          f"{numel / 1e6:.1f}M parameters, Adam, float32, 2 ranks (gloo, CPU)")
    print(f"{'strategy':<9} {'params MiB':>11} {'in step':>8} {'grads MiB':>10} {'optim MiB':>10} "
          f"{'state MiB':>10} {'vs DDP':>7} {'peak MiB':>9} {'step s':>7}")
    ddp_state = None
    for strategy in STRATEGIES:
        results = spawn(memory_worker, 2, strategy, args.width, args.depth, args.batch_size,
                        args.steps, timeout=900)
        worst = max(results, key=lambda r: r["params"] + r["grads"] + r["optimizer"])
        state = worst["params"] + worst["grads"] + worst["optimizer"]
        ddp_state = ddp_state or state
        print(f"{strategy:<9} {worst['params'] / mib:>11.1f} {worst['held'] / mib:>8.1f} "
              f"{worst['grads'] / mib:>10.1f} "
              f"{worst['optimizer'] / mib:>10.1f} {state / mib:>10.1f} {state / ddp_state:>7.3f} "
              f"{max(r['peak'] for r in results) / mib:>9.1f} "
              f"{max(r['step'] for r in results):>7.3f}")


if __name__ == "__main__":
    main()
