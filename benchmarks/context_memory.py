"""Activation memory per rank under context parallel, against one process.

The GPT of ``paratrain.models`` (2 blocks, width 64, 4 heads, batch 1) at long sequences:
cp=1 is one process with torch's own attention (its CPU flash kernel keeps only the
output and log-sum-exp); cp=2 and cp=4 cut the sequence in the load-balanced order over
gloo ranks with ring attention (:mod:`paratrain.strategies.context`). Each rank counts
the bytes autograd saves for backward in one forward (``memory_probe.saved_activations``:
each storage once, parameters excluded) and times one forward + backward.

The cap column answers "how long a sequence trains under a fixed per-rank budget": the
budget is one process's activations at ``--cap-length``; the longest sequence whose
per-rank activations fit, among the lengths measured.

    python benchmarks/context_memory.py                       # 4096 and 8192, cp 1/2/4
    python benchmarks/context_memory.py --lengths 2048,4096 --cps 1,2
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from memory_probe import saved_activations

from paratrain.distributed.spawn import spawn
from paratrain.models import GPT
from paratrain.strategies.context.routing import ContextParallelAttention
from paratrain.strategies.context.sequence import SequenceOrder

VOCAB = 64


def measure(rank: int, cp: int, length: int) -> tuple[int, float]:
    torch.manual_seed(0)
    model = GPT(vocab_size=VOCAB, block_size=length, n_layer=2, n_head=4, n_embd=64)
    tokens = torch.randint(0, VOCAB, (1, length + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    started = time.perf_counter()
    if cp == 1:
        with saved_activations(model.parameters()) as saved:
            loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
    else:
        order = SequenceOrder(cp=cp, length=length)
        inputs, targets = order.slice(inputs, rank), order.slice(targets, rank)
        with saved_activations(model.parameters()) as saved, \
                ContextParallelAttention(dist.group.WORLD, order):
            logits = model(inputs, position_ids=order.positions(rank)[None])
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    loss.backward()
    return saved[0], time.perf_counter() - started


def worker(rank: int, world_size: int, length: int) -> tuple[int, float]:
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    return measure(rank, world_size, length)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="4096,8192")
    parser.add_argument("--cps", default="1,2,4")
    parser.add_argument("--cap-length", type=int, default=4096)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    cps = [int(x) for x in args.cps.split(",")]
    saved: dict[tuple[int, int], int] = {}
    print(f"{'cp':>3} {'length':>7} {'saved MB/rank':>14} {'vs cp=1':>8} {'step s':>7}")
    for length in lengths:
        for cp in cps:
            if cp == 1:
                bytes_, seconds = measure(0, 1, length)
            else:
                per_rank = spawn(worker, cp, length, timeout=600)
                bytes_ = max(b for b, _ in per_rank)
                seconds = max(s for _, s in per_rank)
            saved[cp, length] = bytes_
            ratio = bytes_ / saved[1, length] if (1, length) in saved else float("nan")
            print(f"{cp:>3} {length:>7} {bytes_ / 2**20:>14.2f} {ratio:>8.3f} {seconds:>7.2f}")
    if (1, args.cap_length) in saved:
        cap = saved[1, args.cap_length]
        print(f"\nper-rank cap = cp=1 activations at length {args.cap_length}: "
              f"{cap / 2**20:.2f} MB")
        for cp in cps:
            fits = [n for n in lengths if (cp, n) in saved and saved[cp, n] <= cap]
            print(f"  cp={cp}: longest measured length under the cap: "
                  f"{max(fits) if fits else 'none'}")


if __name__ == "__main__":
    main()
