"""Tokens/s and expert memory per rank of the MoE GPT at ep 1, 2 and 4 on 4 gloo ranks.

Every run is data parallel over the 4 ranks (each reads its quarter of the global
batch); with ``ep`` > 1 the experts of every MoE layer are split over groups of ``ep``
ranks and tokens travel to them by the uneven all-to-all
(:mod:`paratrain.strategies.experts`). Replicated parameters are averaged with one
all-reduce each, expert weights over the ranks holding the same experts. AdamW steps on
the same seeded batches; the median step after the first is reported.

    python benchmarks/expert_parallel.py                  # ep 1, 2, 4 on 4 ranks
    python benchmarks/expert_parallel.py --experts 8 --steps 6
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.distributed.spawn import spawn
from paratrain.models import GPT
from paratrain.strategies.experts.apply import (
    apply_expert_parallel,
    average_expert_gradients,
    expert_parameters,
)
from paratrain.strategies.experts.moe import balance_loss

VOCAB, LENGTH = 128, 64


def worker(rank, world_size, ep, experts, steps, batch):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=LENGTH, n_layer=2, n_head=4, n_embd=128,
                experts=experts, top_k=2)
    replica = None
    if ep > 1:
        groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world_size, ep)]
        replicas = [dist.new_group(list(range(p, world_size, ep))) for p in range(ep)]
        apply_expert_parallel(model, groups[rank // ep], balance_group=dist.group.WORLD)
        replica = replicas[rank % ep] if world_size > ep else None
    split = expert_parameters(model) if ep > 1 else set()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, LENGTH + 1), generator=generator)
        started = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        (loss + 0.01 * balance_loss(model)).backward()
        for param in model.parameters():
            if id(param) in split:
                if replica is not None:
                    dist.all_reduce(param.grad, group=replica)
            else:
                dist.all_reduce(param.grad)
                param.grad.div_(world_size)
        if split:
            average_expert_gradients(model, world_size)
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - started)
    held = sum(p.numel() * p.element_size() for p in model.parameters()
               if id(p) in split or (not split and p.dim() == 3))
    return statistics.median(times[1:]), held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eps", default="1,2,4")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--ranks", type=int, default=4)
    args = parser.parse_args()
    print(f"MoE GPT 2x128, {args.experts} experts top-2, {args.ranks} ranks, "
          f"{args.batch} x {LENGTH} tokens per rank per step")
    print(f"{'ep':>3} {'step s':>8} {'tokens/s':>10} {'vs ep=1':>8} {'expert MB/rank':>15}")
    base = None
    for ep in (int(x) for x in args.eps.split(",")):
        results = spawn(worker, args.ranks, ep, args.experts, args.steps, args.batch, timeout=900)
        step = max(s for s, _ in results)
        tokens = args.ranks * args.batch * LENGTH / step
        base = base or tokens
        held = max(h for _, h in results)
        print(f"{ep:>3} {step:>8.3f} {tokens:>10.0f} {tokens / base:>8.2f} {held / 2**20:>15.2f}")


if __name__ == "__main__":
    main()
