"""GPT training step variants side by side in one process: tokens/s, MFU, ratios (gpu-check).

    python benchmarks/gpu_check_gpt.py --json gpt.json                 # eager, compile, raw+compile
    python benchmarks/gpu_check_gpt.py --variants bf16-mixed+compile float8+compile \
        --layers 16 --width 2048 --batch-size 8 --json f8.json          # float8 vs bf16, ~0.9B
    python benchmarks/gpu_check_gpt.py --accelerator cpu --layers 1 --width 32 --seq-len 16 \
        --batch-size 2 --warmup 1 --steps 2 --compile-backend eager     # plumbing only

The model is ``paratrain.models.GPT`` at ``gpu_peers``' GPT size (12 layers, 768 wide,
12 heads, seq 1024, vocab 50,304; ``peers_report.job_size``) unless resized, AdamW (fused
on CUDA, for every variant), random tokens already on the device (the input path is not
what this measures). Variants:

* ``eager``, ``compile``: ``Run(precision=--precision, compile=False / True)``;
* ``raw+compile``: no Run: ``torch.compile(model)``, bf16 autocast (with bf16-mixed),
  ``loss.backward()``, ``optimizer.step()``: the hand-written baseline;
* ``PRECISION+compile`` (``bf16-mixed+compile``, ``float8+compile``): compiled ``Run``
  at that precision. A ``float8`` variant is skipped, with one line and ``"skipped"``
  in the JSON, where ``float8`` is not one of ``paratrain.config.PRECISIONS``, torchao
  is missing or the GPU is below sm_89.

Each variant builds a fresh model, runs ``--warmup`` untimed steps (compilation happens
there) and times ``--steps`` between two synchronizations. A compiled variant must show
that Dynamo traced it: a forward pre-hook on every leaf module records
``torch.compiler.is_compiling()`` (True only while Dynamo traces), so a run where nothing
compiled reads ``traced: false`` (``compile_s`` alone cannot tell: it times the first
step either way). MFU: the FLOPs per sample ``Run`` counted on the first variant that
counted them, over the device's dense peak for the precision. Rows go to ``--json``
after each variant, so a variant killed by a time budget leaves the ones before it.
"""

from __future__ import annotations

import argparse
import importlib.util
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

FIXED = ("eager", "compile", "raw+compile")
CUDA_BATCH = 16  # GPT-2 small at seq 1024 in bf16-mixed: about 20 GB, far from 80 GB


def parse_variant(name: str, precision: str) -> tuple[str, str, bool]:
    """``(builder, precision, compiled)`` of a variant name; ValueError (one line) if unknown."""
    from paratrain.config import PRECISIONS

    if name in FIXED:
        return ("raw" if name == "raw+compile" else "run"), precision, name != "eager"
    named, _, suffix = name.rpartition("+")
    if suffix == "compile" and named in PRECISIONS:
        return "run", named, True
    raise ValueError(f"unknown variant {name!r}: one of {', '.join(FIXED)} or "
                     f"PRECISION+compile with PRECISION one of {', '.join(PRECISIONS)}")


def float8_unavailable(device: torch.device) -> str | None:
    """Why float8 cannot run here (one line), or None."""
    from paratrain.config import PRECISIONS

    if "float8" not in PRECISIONS:
        return "'float8' is not one of paratrain.config.PRECISIONS in this version"
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'paratrain[float8]')"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"the GPU is sm_{major}{minor}; float8 matmuls need sm_89 or newer"
    return None


def trace_probe(model: torch.nn.Module) -> dict[str, bool]:
    """``{"traced": ...}`` set True when a leaf module runs inside a Dynamo trace."""
    seen = {"traced": False}

    def hook(module: torch.nn.Module, args: Any) -> None:
        if torch.compiler.is_compiling():
            seen["traced"] = True  # a constant store, replayed after each compiled call

    for module in model.modules():
        if not any(True for _ in module.children()):
            module.register_forward_pre_hook(hook)
    return seen


def build(builder: str, size, *, device: torch.device, precision: str, compiled: bool,
          backend: str, peak_flops: float | None) -> tuple[Any, Any, dict, Any, list]:
    """``(step(x, y) -> loss, run or None, probe, close, parameters)`` for one variant."""
    with device:  # initialised where it trains: a 1B model's CPU init takes seconds
        model = make_model("gpt", size)
    probe = trace_probe(model)
    fused = device.type == "cuda"
    if builder == "raw":
        model = model.to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused)
        forward = torch.compile(model, backend=backend) if compiled else model
        bf16 = precision == "bf16-mixed"

        def raw_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                loss = loss_fn(forward(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss
        return raw_step, None, probe, lambda: None, list(model.parameters())
    import paratrain

    option: bool | dict[str, Any] = False
    if compiled:
        option = True if backend == "inductor" else {"backend": backend}
    run = paratrain.Run(strategy="single", accelerator=device.type, precision=precision,
                        compile=option, progress=False, seed=0,
                        tokens_per_sample=size.seq_len, peak_flops=peak_flops)
    model, optimizer = run.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=3e-4, fused=fused))

    def run_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        run.backward(loss)
        run.step(optimizer)
        return loss
    return run_step, run, probe, run.close, list(run.strategy.unwrap(model).parameters())


def time_variant(variant: str, size, *, device: torch.device, precision: str, warmup: int,
                 steps: int, backend: str, peak_flops: float | None,
                 flops_per_sample: float | None) -> dict[str, Any]:
    """Build, warm up and time one variant; a dict row (rates None where n/a)."""
    builder, precision, compiled = parse_variant(variant, precision)
    cuda = fresh_device(device)
    torch.manual_seed(0)
    step, run, probe, close, params = build(builder, size, device=device, precision=precision,
                                    compiled=compiled, backend=backend,
                                    peak_flops=peak_flops)
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        tokens = torch.randint(0, size.vocab_size, (2, size.batch_size, size.seq_len + 1),
                               device=device, generator=gen)
        batches = [(t[:, :-1], t[:, 1:]) for t in tokens]
        started = time.perf_counter()
        for i in range(warmup):
            step(*batches[i % 2])
        if cuda:
            torch.cuda.synchronize(device)
        warmup_s = time.perf_counter() - started
        started = time.perf_counter()
        for i in range(steps):
            loss = step(*batches[i % 2])
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
        counted = None if run is None else run.throughput.flops_per_sample
        compile_s = None if run is None else run.epoch_throughput().get("compile_s")
        peak_mib = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
        final_loss = float(loss.detach().float())
    finally:
        close()
    fps = flops_per_sample if flops_per_sample is not None else counted
    samples_per_s = size.batch_size * steps / elapsed
    rates = Throughput(tokens_per_sample=size.seq_len, peak_flops=peak_flops,
                       flops_per_sample=fps, replicas=1).rates(samples_per_s)
    return {"variant": variant, "precision": precision, "compiled": compiled,
            "parameters": sum(p.numel() for p in params),
            "traced": probe["traced"], "compile_s": compile_s,
            "batch_size": size.batch_size, "seq_len": size.seq_len, "steps": steps,
            "warmup_steps": warmup, "warmup_s": warmup_s, "step_s": elapsed / steps,
            "tokens_per_s": rates["tokens_per_s"],
            "tflops_per_device": rates.get("tflops_per_device"), "mfu": rates["mfu"],
            "flops_per_sample": fps, "peak_mib": peak_mib, "final_loss": final_loss}


def row_ok(row: dict[str, Any]) -> bool:
    """A row proves training ran (a finite loss, a positive token rate) and, compiled,
    that Dynamo traced the model."""
    ran = math.isfinite(row["final_loss"]) and (row["tokens_per_s"] or 0) > 0
    return ran and (row["traced"] or not row.get("compiled", False))


def ratio(rows: list[dict[str, Any]], variant: str, baseline: str) -> float | None:
    """tokens/s of ``variant`` over ``baseline``'s; None when either is missing."""
    speeds = {r["variant"]: r["tokens_per_s"] for r in rows}
    if not speeds.get(variant) or not speeds.get(baseline):
        return None
    return speeds[variant] / speeds[baseline]


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """One line per variant; the ratio column is against the first row."""
    first = rows[0]["variant"] if rows else ""
    lines = [f"| variant | batch x seq | timed steps | step (ms) | tokens/s | vs {first} | "
             "TFLOP/s | MFU | peak MiB | warm-up (s) | traced | final loss |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        tflops = "n/a" if r["tflops_per_device"] is None else f"{r['tflops_per_device']:.1f}"
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        peak = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:,.0f}"
        traced = ("yes" if r["traced"] else "NO") if r.get("compiled") else "-"
        lines.append(f"| {r['variant']} | {r['batch_size']} x {r['seq_len']} | {r['steps']} | "
                     f"{r['step_s'] * 1e3:.1f} | {r['tokens_per_s']:,.0f} | "
                     f"{ratio(rows, r['variant'], first):.2f}x | {tflops} | {mfu} | "
                     f"{peak} | {r['warmup_s']:.1f} | {traced} | {r['final_loss']:.3f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--accelerator", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--variants", nargs="+", default=list(FIXED),
                   help="eager, compile, raw+compile or PRECISION+compile (default: the three)")
    p.add_argument("--batch-size", type=int, default=None,
                   help=f"default {CUDA_BATCH} on cuda, the CPU size's on cpu")
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--width", type=int, default=None, help="n_embd; heads of 64")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--precision", default=None, choices=("32", "bf16-mixed"),
                   help="of eager, compile and raw+compile; default bf16-mixed on cuda, 32 on cpu")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled variants (eager: plumbing only)")
    p.add_argument("--peak-flops", type=float, default=None,
                   help="device peak FLOP/s for MFU (default: paratrain's table for the GPU)")
    p.add_argument("--json", default=None, help="write the rows here (after each variant)")
    args = p.parse_args(argv)
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        p.error("--accelerator cuda: no CUDA device visible; use --accelerator cpu")
    if args.warmup < 1 or args.steps < 1:
        p.error("--warmup and --steps must be >= 1 (the first step counts the FLOPs)")
    args.precision = args.precision or ("bf16-mixed" if args.accelerator == "cuda" else "32")
    try:
        args.parsed = [parse_variant(v, args.precision) for v in args.variants]
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.accelerator)
    batch = args.batch_size or (CUDA_BATCH if args.accelerator == "cuda" else None)
    size = job_size("gpt", accelerator=args.accelerator, batch_size=batch, seq_len=args.seq_len,
                    n_layer=args.layers, n_embd=args.width)
    first_precision = args.parsed[0][1]
    peak = device_peak_flops(device=device, precision=first_precision, override=args.peak_flops)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = {"device": name, "precision": first_precision, "peak_flops": peak,
              "model": {"n_layer": size.n_layer, "n_embd": size.n_embd, "n_head": size.n_head,
                        "vocab_size": size.vocab_size}}
    print(f"GPT {size.n_layer} x {size.n_embd} ({size.n_head} heads, vocab {size.vocab_size}), "
          f"seq {size.seq_len}, batch {size.batch_size} on {name}; peak "
          f"{'n/a' if peak is None else f'{peak / 1e12:.1f} TFLOP/s'}", flush=True)
    reason = float8_unavailable(device) if any(p == "float8" for _, p, _ in args.parsed) \
        else None
    if reason:
        print(f"skipping float8: {reason}")
        if args.json:
            Path(args.json).write_text(json.dumps(header | {"skipped": reason, "rows": []}))
        return 0
    rows: list[dict[str, Any]] = []
    fps = None
    for variant in args.variants:
        row = time_variant(variant, size, device=device, precision=args.precision,
                           warmup=args.warmup, steps=args.steps, backend=args.compile_backend,
                           peak_flops=peak, flops_per_sample=fps)
        fps = fps if fps is not None else row["flops_per_sample"]
        rows.append(row)
        header["model"]["parameters"] = row["parameters"]
        print(f"  {variant}: {row['tokens_per_s']:,.0f} tokens/s"
              + ("" if not row["compiled"] else f", traced: {row['traced']}"), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(header | {"rows": rows}, indent=2) + "\n")
    print()
    print(markdown_table(rows))
    return 0 if all(row_ok(r) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
