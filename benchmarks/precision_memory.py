"""Step time and memory: float32 vs bf16-mixed, with and without activation checkpointing.

Each configuration trains a small transformer encoder for a few steps through
``paratrain.Run`` in its own fresh process (so peak-memory readings do not mix),
then one table compares them side by side.

Memory columns on CPU: "activations" is the growth of the process's resident
memory from before the forward pass to just before backward (what the autograd
graph holds), median over steps; "peak" is the process's peak RSS (model,
optimizer, activations, Python and torch). On CUDA both come from the caching
allocator (allocated after forward minus before; max allocated). The device is the one
a run would use: CUDA when visible (``--accelerator auto``), else the CPU.

    python benchmarks/precision_memory.py                       # full size
    python benchmarks/precision_memory.py --layers 4 --seq 128 --batch 8 --steps 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

CONFIGS = [("32", False), ("bf16-mixed", False), ("32", True), ("bf16-mixed", True)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--layers", type=int, default=8)
    add("--d-model", type=int, default=256)
    add("--heads", type=int, default=4)
    add("--seq", type=int, default=256)
    add("--batch", type=int, default=16)
    add("--steps", type=int, default=5, help="measured steps (after one warm-up step)")
    add("--threads", type=int, default=None, help="torch threads per process (default: torch's)")
    add("--accelerator", choices=("auto", "cpu", "cuda"), default="auto",
        help="auto: CUDA when visible (default), cpu or cuda")
    add("--one", default=None, help=argparse.SUPPRESS)  # PRECISION,CKPT: run one config here
    return parser


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(args: argparse.Namespace, precision: str, checkpointing: bool) -> dict:
    import torch
    from torch import nn

    import paratrain

    if args.threads:
        torch.set_num_threads(args.threads)
    spec = nn.TransformerEncoderLayer if checkpointing else None
    with paratrain.Run(strategy="single", precision=precision, accelerator=args.accelerator,
                       progress=False, seed=0, checkpoint_activations=spec) as run:
        layer = nn.TransformerEncoderLayer(args.d_model, args.heads, 4 * args.d_model,
                                           dropout=0.0, batch_first=True)
        model = nn.Sequential(nn.TransformerEncoder(layer, args.layers, enable_nested_tensor=False),
                              nn.Linear(args.d_model, 1))
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-4))
        x = torch.randn(args.batch, args.seq, args.d_model, device=run.device)
        cuda = run.device.type == "cuda"
        used = (lambda: torch.cuda.memory_allocated(run.device)) if cuda else resident_bytes
        times, activations = [], []
        for step in range(args.steps + 1):
            if cuda:
                torch.cuda.synchronize(run.device)
            start = time.perf_counter()
            before = used()
            loss = model(x).float().pow(2).mean()
            after_forward = used()
            run.backward(loss)
            run.step(optimizer)
            if cuda:
                torch.cuda.synchronize(run.device)
            if step:  # step 0 warms up allocators and kernels
                times.append(time.perf_counter() - start)
                activations.append(after_forward - before)
            del loss
        peak = (torch.cuda.max_memory_allocated(run.device) if cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    return {"precision": precision, "checkpointing": checkpointing, "device": str(run.device),
            "step_s": statistics.median(times), "activation_mb": statistics.median(activations) / 2**20,
            "peak_mb": peak / 2**20}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.one:
        precision, ckpt = args.one.split(",")
        print(json.dumps(measure(args, precision, ckpt == "1")))
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    # A fixed mmap threshold makes freed tensors leave the resident set at once, so the
    # RSS difference across the forward pass is what the graph holds (glibc otherwise
    # raises the threshold and keeps freed memory in its heap).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    rows = []
    for precision, ckpt in CONFIGS:
        done = subprocess.run([sys.executable, __file__, *forwarded, "--one",
                               f"{precision},{int(ckpt)}"], capture_output=True, text=True,
                              timeout=1800, env=env)
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return done.returncode
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"transformer encoder: {args.layers} layers, d_model {args.d_model}, seq {args.seq}, "
          f"batch {args.batch}, {args.steps} measured steps, {rows[0]['device']}")
    print("| precision | act. ckpt | step (s) | activations (MiB) | peak (MiB) |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['precision']} | {'yes' if r['checkpointing'] else 'no'} | {r['step_s']:.3f} "
              f"| {r['activation_mb']:.0f} | {r['peak_mb']:.0f} |")
    by = {(r["precision"], r["checkpointing"]): r for r in rows}
    print()
    for precision in ("32", "bf16-mixed"):
        plain, ckpt = by[(precision, False)], by[(precision, True)]
        cut = 1 - ckpt["activation_mb"] / max(plain["activation_mb"], 1e-9)
        extra = ckpt["step_s"] / plain["step_s"] - 1
        print(f"{precision}: activation checkpointing cuts activation memory by {cut:.0%} "
              f"for {extra:+.0%} step time")
    ratio = by[("32", False)]["step_s"] / by[("bf16-mixed", False)]["step_s"]
    print(f"bf16-mixed speed-up over float32 (no checkpointing): {ratio:.2f}x "
          "(above 1: bf16-mixed is faster)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
