"""GPT-2-small under ``paratrain.Run``: tokens/s and MFU, eager and compiled (a gpu-check section).

    python benchmarks/gpu_check_gpt.py --json gpt.json                      # CUDA, GPT-2 small
    python benchmarks/gpu_check_gpt.py --accelerator cpu --layers 1 --width 32 --seq-len 16 \
        --batch-size 2 --warmup 1 --steps 2 --compile-backend eager         # plumbing only

The model is ``paratrain.models.GPT`` at ``gpu_peers``' GPT size (12 layers, 768 wide,
12 heads, seq 1024, vocab 50,304; ``peers_report.job_size``) with bf16-mixed on CUDA,
AdamW, random tokens already on the device (the input path is not what this measures).
Each variant builds a fresh ``Run`` and model, runs ``--warmup`` untimed steps
(compilation happens there) and times ``--steps`` between two synchronizations.

MFU uses ``paratrain.run.flops``: the FLOPs per sample that ``Run`` counted on the eager
variant's first step (``FlopCounterMode``; the compiled variant computes the same model,
so it is divided by the same count) over the device's dense peak for the precision.
Rows are written to ``--json`` after each variant, so a variant killed by a time budget
leaves the ones before it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from gpu_peers import fresh_device, loss_fn, make_model
from peers_report import job_size

from paratrain.run.flops import Throughput, device_peak_flops

VARIANTS = ("eager", "compile")
CUDA_BATCH = 16  # GPT-2 small at seq 1024 in bf16-mixed: about 20 GB, far from 80 GB


def compile_option(variant: str, backend: str) -> bool | dict[str, Any]:
    """``Run(compile=...)`` for ``variant``; the backend only matters when compiling."""
    if variant == "eager":
        return False
    return True if backend == "inductor" else {"backend": backend}


def time_variant(variant: str, size, *, device: torch.device, precision: str, warmup: int,
                 steps: int, backend: str, peak_flops: float | None,
                 flops_per_sample: float | None) -> dict[str, Any]:
    """Build, warm up and time one variant; a dict row (rates None where n/a)."""
    import paratrain

    cuda = fresh_device(device)
    run = paratrain.Run(strategy="single", accelerator=device.type, precision=precision,
                        compile=compile_option(variant, backend), progress=False, seed=0,
                        tokens_per_sample=size.seq_len, peak_flops=peak_flops)
    try:
        model = make_model("gpt", size)
        model, optimizer = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
        gen = torch.Generator(device=run.device).manual_seed(0)
        tokens = torch.randint(0, size.vocab_size, (2, size.batch_size, size.seq_len + 1),
                               device=run.device, generator=gen)
        batches = [(t[:, :-1], t[:, 1:]) for t in tokens]

        def step(i: int) -> torch.Tensor:
            x, y = batches[i % len(batches)]
            loss = loss_fn(model(x), y)
            run.backward(loss)
            run.step(optimizer)
            return loss

        started = time.perf_counter()
        for i in range(warmup):
            step(i)
        if cuda:
            torch.cuda.synchronize(device)
        warmup_s = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(steps):
            loss = step(i)
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
        counted = run.throughput.flops_per_sample
        peak_mib = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
        final_loss = float(loss.detach().float())
    finally:
        run.close()
    fps = flops_per_sample if flops_per_sample is not None else counted
    samples_per_s = size.batch_size * steps / elapsed
    rates = Throughput(tokens_per_sample=size.seq_len, peak_flops=peak_flops,
                       flops_per_sample=fps, replicas=1).rates(samples_per_s)
    return {"variant": variant, "batch_size": size.batch_size, "seq_len": size.seq_len,
            "steps": steps, "warmup_steps": warmup, "warmup_s": warmup_s,
            "step_s": elapsed / steps, "tokens_per_s": rates["tokens_per_s"],
            "tflops_per_device": rates.get("tflops_per_device"), "mfu": rates["mfu"],
            "flops_per_sample": fps, "peak_mib": peak_mib, "final_loss": final_loss}


def row_ok(row: dict[str, Any]) -> bool:
    """A row proves training ran: a finite loss and a positive token rate."""
    return math.isfinite(row["final_loss"]) and (row["tokens_per_s"] or 0) > 0


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per variant: tokens/s, achieved TFLOP/s, MFU, peak memory, warm-up time."""
    lines = ["| variant | batch x seq | timed steps | step (ms) | tokens/s | TFLOP/s | MFU | "
             "peak MiB | warm-up (s) | final loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        tflops = "n/a" if r["tflops_per_device"] is None else f"{r['tflops_per_device']:.1f}"
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        peak = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f}"
        lines.append(f"| {r['variant']} | {r['batch_size']} x {r['seq_len']} | {r['steps']} | "
                     f"{r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | {tflops} | {mfu} | "
                     f"{peak} | {r['warmup_s']:.1f} | {r['final_loss']:.3f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"default {CUDA_BATCH} on cuda, the CPU size's on cpu")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None, help="n_embd; heads of 64")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--precision", default=None, choices=("32", "bf16-mixed"),
                   help="default: bf16-mixed on cuda, 32 on cpu")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compile variant (eager: plumbing only)")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="device peak FLOP/s for MFU (default: paratrain's table for the GPU)")
    p.add_argument("--json", default=None, help="write the rows here (after each variant)")
    args = p.parse_args(argv)
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        p.error("--accelerator cuda: no CUDA device visible; use --accelerator cpu")
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the first step counts the FLOPs)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.accelerator)
    batch = args.batch_size or (CUDA_BATCH if args.accelerator == "cuda" else None)
    size = job_size("gpt", accelerator=args.accelerator, batch_size=batch, seq_len=args.seq_len,
                    n_layer=args.layers, n_embd=args.width)
    precision = args.precision or ("bf16-mixed" if args.accelerator == "cuda" else "32")
    peak = device_peak_flops(device=device, precision=precision, override=args.peak_flops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"GPT {size.n_layer} x {size.n_embd} ({size.n_head} heads), seq {size.seq_len}, "
          f"vocab {size.vocab_size}, batch {size.batch_size}, {precision} on {name}; peak "
          f"{'n/a' if peak is None else f'{peak / 1e12:.1f} TFLOP/s'}", flush=True)
    rows: list[dict[str, Any]] = []
    fps = None
    for variant in args.variants:
        row = time_variant(variant, size, device=device, precision=precision,
                           warmup=args.warmup, steps=args.steps, backend=args.compile_backend,
                           peak_flops=peak, flops_per_sample=fps)
        fps = fps if fps is not None else row["flops_per_sample"]
        rows.append(row)
        mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        print(f"  {variant}: {row['tokens_per_s']:,.0f} tokens/s, MFU {mfu}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(
                {"device": name, "precision": precision, "peak_flops": peak,
                 "model": {"n_layer": size.n_layer, "n_embd": size.n_embd,
                           "n_head": size.n_head, "vocab_size": size.vocab_size},
                 "rows": rows}, indent=2) + "\n")
    print()
    print(markdown_table(rows))
    return 0 if all(row_ok(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
