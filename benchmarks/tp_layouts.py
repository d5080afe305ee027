"""Per-rank memory and step time of a small GPT under single, ddp, fsdp, tp, fsdp_tp and
hybrid's pipeline layouts (pipeline x FSDP, pipeline x TP, the 3-D pipeline x FSDP x TP).

Every layout trains the same global batch (``tp`` ranks all read it whole; data-parallel
ranks read their share) for a few AdamW steps on gloo CPU processes. Each rank reports the
bytes it holds in parameters, gradients and optimizer state (local shards), its peak
resident memory above the baseline taken before the model was built, the activations
autograd saves for backward in one step (this rank's part), and the median step time after
the first step.

    python benchmarks/tp_layouts.py                                  # 2 ranks
    python benchmarks/tp_layouts.py --layouts fsdp_tp --ranks 4      # 2-D, 4 ranks
    python benchmarks/tp_layouts.py --layouts pp_fsdp,pp_tp,pp_fsdp_tp  # 4, 4 and 8 ranks
    python benchmarks/tp_layouts.py --layouts ddp,tp,tp_sp,tp_sp_lp    # sequence/loss parallel
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from memory_probe import local_bytes, max_rss, optimizer_state_bytes, saved_activations

import paratrain
from paratrain.distributed.spawn import spawn
from paratrain.models import GPT

_PIPELINE = {"schedule": "1f1b", "num_microbatches": 2}
#: layout -> (strategy, options, ranks; None: --ranks)
LAYOUTS = {
    "single": ("single", {}, 1),
    "ddp": ("ddp", {}, None),
    "fsdp": ("fsdp", {}, None),
    "tp": ("tp", {}, None),
    "fsdp_tp": ("fsdp_tp", {"tensor_degree": 2}, None),
    "tp_sp": ("tp", {"sequence_parallel": True}, None),
    "tp_sp_lp": ("tp", {"sequence_parallel": True, "loss_parallel": True}, None),
    "fsdp_tp_sp_lp": ("fsdp_tp", {"tensor_degree": 2, "sequence_parallel": True,
                                  "loss_parallel": True}, None),
    "pp_fsdp": ("hybrid", {"pipeline_degree": 2, "shard_degree": 2, "pipeline": _PIPELINE}, 4),
    "pp_tp": ("hybrid", {"pipeline_degree": 2, "tensor_degree": 2, "pipeline": _PIPELINE}, 4),
    "pp_fsdp_tp": ("hybrid", {"pipeline_degree": 2, "shard_degree": 2, "tensor_degree": 2,
                              "pipeline": _PIPELINE}, 8),
}


def worker(rank, world_size, layout, config, global_batch, num_steps):
    torch.set_num_threads(1)
    strategy, options, _ = LAYOUTS[layout]
    run = paratrain.Run(strategy=strategy, strategy_options=options, progress=False,
                        accelerator="cpu", seed=0)
    baseline = max_rss()
    torch.manual_seed(0)
    model = GPT(vocab_size=config["vocab"], block_size=config["seq"], n_layer=config["depth"],
                n_head=config["heads"], n_embd=config["width"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = run.prepare(model, optimizer)
    batch = global_batch // run.strategy.data_parallel_size
    g = torch.Generator().manual_seed(run.strategy.data_parallel_rank)
    times, grads, activations = [], 0, 0
    for _ in range(num_steps + 1):
        idx = torch.randint(0, config["vocab"], (batch, config["seq"] + 1), generator=g)
        run.strategy.barrier()
        start = time.perf_counter()
        # (B, vocab, T) logits: a pipeline splits the (B, T) targets with the batch.
        with saved_activations(model.parameters()) as saved:
            loss = F.cross_entropy(model(idx[:, :-1]).transpose(1, 2), idx[:, 1:])
        activations = saved[0]
        run.backward(loss)
        grads = local_bytes(p.grad for p in model.parameters())
        run.step(optimizer)
        run.strategy.barrier()
        times.append(time.perf_counter() - start)
    params = local_bytes(model.parameters())
    state = optimizer_state_bytes(optimizer)
    peak = max_rss() - baseline
    run.close()
    return {"state": params + grads + state, "peak": peak, "saved": activations,
            "step": statistics.median(times[1:])}


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
    layouts = [name for name in args.layouts.split(",") if name]
    unknown = sorted(set(layouts) - set(LAYOUTS))
    if unknown:
        parser.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    print(f"{'layout':<14} {'ranks':>5} {'state MiB/rank':>15} {'saved MiB/rank':>15} "
          f"{'peak MiB/rank':>14} {'step ms':>8}")
    for layout in layouts:
        ranks = LAYOUTS[layout][2] or args.ranks
        results = spawn(worker, ranks, layout, config, args.global_batch, args.steps,
                        timeout=900)
        print(f"{layout:<14} {ranks:>5} {max(r['state'] for r in results) / mib:>15.2f} "
              f"{max(r['saved'] for r in results) / mib:>15.2f} "
              f"{max(r['peak'] for r in results) / mib:>14.1f} "
              f"{max(r['step'] for r in results) * 1e3:>8.1f}")


if __name__ == "__main__":
    main()
