"""Per-rank memory and step time of a small GPT under single, ddp, fsdp, tp and fsdp_tp.

Every layout trains the same global batch (``tp`` ranks all read it whole; data-parallel
ranks read their share) for a few AdamW steps on gloo CPU processes. Each rank reports the
bytes it holds in parameters, gradients and optimizer state (local shards), its peak
resident memory above the baseline taken before the model was built, and the median
step time after the first step.

    python benchmarks/tp_layouts.py                                  # 2 ranks
    python benchmarks/tp_layouts.py --layouts fsdp_tp --ranks 4      # 2-D, 4 ranks
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.distributed.spawn import spawn


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.n_head = heads  # divided by the tensor degree under tp
        self.q, self.k, self.v = (nn.Linear(width, width, bias=False) for _ in range(3))
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (f(x).view(b, t, self.n_head, -1).transpose(1, 2)
                   for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.fc, self.proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, *, vocab: int, width: int, heads: int, depth: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor):
            local = t.to_local() if hasattr(t, "to_local") else t
            total += local.numel() * local.element_size()
    return total


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker(rank, world_size, layout, config, global_batch, num_steps):
    torch.set_num_threads(1)
    options = {"tensor_degree": 2} if layout == "fsdp_tp" else {}
    run = paratrain.Run(strategy=layout, strategy_options=options, progress=False,
                        accelerator="cpu", seed=0)
    baseline = _max_rss()
    torch.manual_seed(0)
    model = GPT(**config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = run.prepare(model, optimizer)
    batch = global_batch // run.strategy.data_parallel_size
    g = torch.Generator().manual_seed(run.strategy.data_parallel_rank)
    times, grads = [], 0
    for _ in range(num_steps + 1):
        idx = torch.randint(0, config["vocab"], (batch, config["seq"] + 1), generator=g)
        run.strategy.barrier()
        start = time.perf_counter()
        logits = model(idx[:, :-1])
        run.backward(F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten()))
        grads = _bytes(p.grad for p in model.parameters())
        run.step(optimizer)
        run.strategy.barrier()
        times.append(time.perf_counter() - start)
    params = _bytes(model.parameters())
    state = _bytes(v for s in optimizer.state.values() for v in s.values() if v.dim() > 0)
    peak = _max_rss() - baseline
    run.close()
    return {"state": params + grads + state, "peak": peak, "step": statistics.median(times[1:])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--layouts", default="single,ddp,fsdp,tp")
    args = parser.parse_args()
    config = dict(vocab=args.vocab, width=args.width, heads=args.heads, depth=args.depth,
                  seq=args.seq)
    mib = 2**20
    print(f"GPT: {args.depth} blocks, width {args.width}, {args.heads} heads, seq {args.seq}, "
          f"vocab {args.vocab}; AdamW, float32, global batch {args.global_batch}, gloo CPU")
    print(f"{'layout':<8} {'ranks':>5} {'state MiB/rank':>15} {'peak MiB/rank':>14} "
          f"{'step ms':>8}")
    for layout in [name for name in args.layouts.split(",") if name]:
        ranks = 1 if layout == "single" else args.ranks
        results = spawn(worker, ranks, layout, config, args.global_batch, args.steps,
                        timeout=900)
        print(f"{layout:<8} {ranks:>5} {max(r['state'] for r in results) / mib:>15.2f} "
              f"{max(r['peak'] for r in results) / mib:>14.1f} "
              f"{max(r['step'] for r in results) * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
