"""Numerics record: per-step losses of a fixed-seed run of every CPU strategy, bit for bit.

A change that only moves code must leave every number here unchanged. Record once before
the change and check after it:

    python benchmarks/loss_record.py --out /tmp/before.json
    python benchmarks/loss_record.py --check benchmarks/loss_record.baseline.json

The bits depend on the CPU's kernels (vendor, AVX2 vs AVX-512), so the committed
``loss_record.baseline.json`` only holds on the machine kind that wrote it: on another
machine, record the previous commit there first (a ``git worktree`` with its ``src`` on
``PYTHONPATH``), then check the change against that record.

Each case trains a few steps on gloo ranks (the spawn helper) and records the rank-mean
loss of every step as ``float.hex`` plus a digest of every rank's final local parameters.
The ``demo`` case is the first 50 steps of ``paratrain demo`` (ConvNet, Fashion-MNIST,
2 ranks, ``ddp``). ``--check`` prints a table and exits 1 at the first difference.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.distributed.spawn import spawn
from paratrain.strategies.capabilities import local_module
from paratrain.testing.reference import synthetic_classification, train_steps

# name -> (processes, Run keyword arguments)
CASES: dict[str, tuple[int, dict]] = {
    "single": (1, {"strategy": "single"}),
    "ddp": (2, {"strategy": "ddp"}),
    "ddp-bf16-mixed": (2, {"strategy": "ddp", "precision": "bf16-mixed"}),
    "ddp-accumulate2-clip": (2, {"strategy": "ddp", "accumulate": 2, "max_grad_norm": 0.5}),
    "ddp-checkpoint-activations": (2, {"strategy": "ddp", "checkpoint_activations": nn.Linear}),
    "fsdp": (2, {"strategy": "fsdp"}),
    "pipeline-1f1b": (2, {"strategy": "pipeline",
                          "strategy_options": {"schedule": "1f1b", "num_microbatches": 2}}),
    "pipeline-gpipe": (2, {"strategy": "pipeline",
                           "strategy_options": {"schedule": "gpipe", "num_microbatches": 2}}),
    "hybrid": (2, {"strategy": "hybrid"}),
    "ps-sync": (3, {"strategy": "ps", "strategy_options": {"num_servers": 1}}),
    "zero1": (2, {"strategy": "zero1"}),
    "zero2": (2, {"strategy": "zero2"}),
}
# name -> (processes, Run keyword arguments): a small GPT on token data (tensor parallel
# needs transformer blocks).
GPT_CASES: dict[str, tuple[int, dict]] = {
    "gpt-tp": (2, {"strategy": "tp"}),
    "gpt-tp-sp-lp": (2, {"strategy": "tp", "strategy_options": {"sequence_parallel": True,
                                                               "loss_parallel": True}}),
    "gpt-fsdp_tp": (4, {"strategy": "fsdp_tp"}),
}
NUM_STEPS = 6


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 3))


def local_digest(run: paratrain.Run, model: nn.Module) -> str:
    """sha256 of this rank's local parameter bytes (DTensor shards as held)."""
    digest = hashlib.sha256()
    state = local_module(run.strategy, model).state_dict()
    for name in sorted(state):
        value = state[name]
        local = value.to_local() if hasattr(value, "to_local") else value
        digest.update(name.encode())
        digest.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def strategy_case(rank: int, world_size: int, kwargs: dict) -> dict:
    run = paratrain.Run(progress=False, accelerator="cpu", seed=7, **kwargs)
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    try:
        model, optimizer = run.prepare(model, optimizer)
    except SystemExit:  # a parameter-server rank serves in prepare() and then exits
        return {"losses": [], "digest": "server"}
    loader = run.loader(synthetic_classification(192), batch_size=8, shuffle=True)
    losses = train_steps(run, model, optimizer, loader, num_steps=NUM_STEPS * run.config.accumulate)
    digest = local_digest(run, model)
    run.close()
    return {"losses": [float(v).hex() for v in losses], "digest": digest}


def gpt_case(rank: int, world_size: int, kwargs: dict) -> dict:
    from paratrain.models import GPT

    run = paratrain.Run(progress=False, accelerator="cpu", seed=7, **kwargs)
    torch.manual_seed(7)
    model = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model, optimizer = run.prepare(model, optimizer)
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 32, (NUM_STEPS, 8, 9), generator=g)
    size, index = run.strategy.data_parallel_size, run.strategy.data_parallel_rank
    losses = []
    for step in range(NUM_STEPS):
        batch = data[step].chunk(size)[index]
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        run.backward(loss)
        run.step(optimizer)
        losses.append(float(run.mean(loss)).hex())
    digest = local_digest(run, model)
    run.close()
    return {"losses": losses, "digest": digest}


def demo_case(rank: int, world_size: int, num_steps: int) -> dict:
    from paratrain.datasets.images import fashion_mnist
    from paratrain.models import convnet

    run = paratrain.Run(strategy="ddp", progress=False, accelerator="cpu", seed=0)
    model = convnet()
    model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
    loader = run.loader(fashion_mnist("train", limit=64 * 2 * num_steps), batch_size=64,
                        shuffle=True)
    losses = []
    for _ in run.epochs(1):
        for step, (x, y) in enumerate(loader):
            if step == num_steps:
                break
            loss = F.cross_entropy(model(x), y)
            run.backward(loss)
            run.step(optimizer)
            losses.append(float(loss.detach()).hex())  # rank-local: no extra collective
    digest = local_digest(run, model)
    run.close()
    return {"losses": losses, "digest": digest}


def record(names: list[str]) -> dict:
    results = {}
    for name in names:
        started = time.perf_counter()
        if name == "demo":
            per_rank = spawn(demo_case, 2, 50, timeout=600)
        elif name in GPT_CASES:
            num_procs, kwargs = GPT_CASES[name]
            per_rank = spawn(gpt_case, num_procs, kwargs, timeout=600)
        else:
            num_procs, kwargs = CASES[name]
            per_rank = spawn(strategy_case, num_procs, kwargs, timeout=600)
        results[name] = per_rank
        print(f"{name:28s} {len(per_rank)} rank(s)  {time.perf_counter() - started:5.1f} s",
              file=sys.stderr)
    return results


def compare(found: dict, expected: dict) -> int:
    failures = 0
    print(f"{'case':28s} {'losses':>8s} {'params':>8s}")
    for name, ranks in expected.items():
        if name not in found:
            continue
        same_losses = all(a["losses"] == b["losses"] for a, b in zip(found[name], ranks))
        same_params = all(a["digest"] == b["digest"] for a, b in zip(found[name], ranks))
        failures += (not same_losses) + (not same_params)
        print(f"{name:28s} {'equal' if same_losses else 'DIFFER':>8s} "
              f"{'equal' if same_params else 'DIFFER':>8s}")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [*CASES, *GPT_CASES, "demo"]
    parser.add_argument("--cases", default=",".join(names),
                        help="comma-separated subset of: " + ", ".join(names))
    parser.add_argument("--out", default=None, help="write the record here (JSON)")
    parser.add_argument("--check", default=None, help="compare with this record")
    args = parser.parse_args()
    names = [n for n in args.cases.split(",") if n]
    unknown = sorted(set(names) - {*CASES, *GPT_CASES, "demo"})
    if unknown:
        parser.error(f"unknown case(s) {unknown}")
    results = record(names)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    if args.check:
        with open(args.check) as f:
            return compare(results, json.load(f))
    return 0


if __name__ == "__main__":
    sys.exit(main())
