"""Three jobs in raw PyTorch, Accelerate, Lightning Fabric and paratrain, side by side.

    python benchmarks/gpu_peers.py --accelerator cuda
    python benchmarks/gpu_peers.py --accelerator cpu      # small sizes, a few minutes

Jobs: the demo's ConvNet on Fashion-MNIST (batch 64, float32); ResNet-18 with a 32x32
stem on synthetic 32x32 images (batch 256, bf16 autocast); a GPT-2-small-sized
``paratrain.models.GPT`` (12 x 768, seq 1024, batch 8, bf16) on random tokens. On CPU
the sizes are small and every job runs in float32 (``--precision`` changes it). Each
framework is written as its documentation shows it, data included: raw PyTorch
iterates a ``DataLoader``, Accelerate ``prepare``s the model, optimizer and loader,
Fabric uses ``setup`` and ``setup_dataloaders``, paratrain ``run.prepare`` and
``run.loader`` (its batched input path is on by default). paratrain also runs with
``compile=True`` and, on CUDA, ``compile={"mode": "reduce-overhead"}`` (CUDA graphs);
a second table gives each compiled variant's samples/s over eager paratrain's, from
the same run (gpu-check's CUDA graphs claim: ConvNet, batch 64, at least 2x).
``--json`` writes every repeat's numbers; ``--compile-backend eager`` walks the
compiled variants' path without code generation (plumbing only).

One process, one device. Every (variant, repeat) builds its model, optimizer and
loader afresh, runs ``--warmup`` untimed steps (compilation happens there) and times
``--steps``; the variants alternate order between repeats (ABAB...). Prints samples/s,
the ratio to the best of raw/Accelerate/Fabric and peak memory (CUDA max allocated;
on CPU the process's resident memory after the steps, which includes what earlier
variants left to the allocator) as a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from peers_report import (
    JOBS,
    JobSize,
    Result,
    interleaved,
    job_precision,
    job_size,
    markdown_table,
    variants,
)
from torch.utils.data import DataLoader, TensorDataset

Batch = tuple[torch.Tensor, torch.Tensor]
PEER_MODULES = {"accelerate": "accelerate", "fabric": "lightning"}


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # Class logits (B, C) or token logits (B, T, V); float32 loss for every framework,
    # whatever dtype its forward returns.
    return F.cross_entropy(out.float().flatten(0, -2), y.flatten())


def make_dataset(job: str, size: JobSize, data_dir: str | None) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    if job == "convnet":
        from paratrain.datasets import fashion_mnist
        return fashion_mnist("train", data_dir=data_dir, limit=size.samples)
    if job == "resnet18":
        images = torch.randn(size.samples, 3, 32, 32, generator=gen)
        return TensorDataset(images, torch.randint(0, 10, (size.samples,), generator=gen))
    tokens = torch.randint(0, size.vocab_size, (size.samples, size.seq_len + 1), generator=gen)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def make_model(job: str, size: JobSize) -> torch.nn.Module:
    torch.manual_seed(0)
    if job == "convnet":
        from paratrain.models import convnet
        return convnet()
    if job == "resnet18":
        import torchvision
        model = torchvision.models.resnet18(num_classes=10)
        # CIFAR-style stem: 32x32 inputs would shrink to 1x1 through the ImageNet one.
        model.conv1 = torch.nn.Conv2d(3, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = torch.nn.Identity()
        return model
    from paratrain.models import GPT
    return GPT(vocab_size=size.vocab_size, block_size=size.seq_len, n_layer=size.n_layer,
               n_head=size.n_head, n_embd=size.n_embd)


def make_optimizer(job: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if job == "resnet18":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-3)


def forever(loader: Any) -> Iterator[Batch]:
    epoch = 0
    while True:
        set_epoch = getattr(loader, "set_epoch", None) or getattr(
            getattr(loader, "sampler", None), "set_epoch", None)
        if set_epoch is not None:
            set_epoch(epoch)
        yield from loader
        epoch += 1


# -- one builder per framework: (step(x, y), infinite batches on the device, cleanup) ----

def build_raw(job, size, dataset, device, precision, compile_opts):
    model = make_model(job, size).to(device)
    optimizer = make_optimizer(job, model)
    loader = DataLoader(dataset, batch_size=size.batch_size, shuffle=True,
                        pin_memory=device.type == "cuda")
    bf16 = precision == "bf16-mixed"

    def step(x, y):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = loss_fn(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, forever(loader), lambda: None


def build_accelerate(job, size, dataset, device, precision, compile_opts):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    accelerator = Accelerator(cpu=device.type == "cpu",
                              mixed_precision="bf16" if precision == "bf16-mixed" else "no")
    model = make_model(job, size)
    loader = DataLoader(dataset, batch_size=size.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, make_optimizer(job, model), loader)

    def step(x, y):
        loss = loss_fn(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def cleanup():
        accelerator.free_memory()
        # Accelerate keeps one process-wide state that refuses a second mixed-precision
        # setting; its own tests reset it the same way between configurations.
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    return step, forever(loader), cleanup


def build_fabric(job, size, dataset, device, precision, compile_opts):
    from lightning.fabric import Fabric
    fabric = Fabric(accelerator=device.type, devices=1,
                    precision="bf16-mixed" if precision == "bf16-mixed" else "32-true")
    model = make_model(job, size)
    model, optimizer = fabric.setup(model, make_optimizer(job, model))
    loader = fabric.setup_dataloaders(
        DataLoader(dataset, batch_size=size.batch_size, shuffle=True))

    def step(x, y):
        loss = loss_fn(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, forever(loader), lambda: None


def build_paratrain(job, size, dataset, device, precision, compile_opts):
    import paratrain
    run = paratrain.Run(accelerator=device.type, precision=precision, compile=compile_opts,
                        progress=False, seed=0)
    model = make_model(job, size)
    model, optimizer = run.prepare(model, make_optimizer(job, model))
    loader = run.loader(dataset, batch_size=size.batch_size)

    def step(x, y):
        loss = loss_fn(model(x), y)
        run.backward(loss)
        run.step(optimizer)
    return step, forever(loader), run.close


BUILDERS: dict[str, Callable[..., Any]] = {
    "raw": build_raw, "accelerate": build_accelerate, "fabric": build_fabric,
    "paratrain": build_paratrain, "paratrain+compile": build_paratrain,
    "paratrain+cudagraphs": build_paratrain,
}
COMPILE = {"paratrain+compile": {}, "paratrain+cudagraphs": {"mode": "reduce-overhead"}}


def compile_option(variant: str, backend: str) -> bool | dict[str, Any]:
    """``Run(compile=...)`` of ``variant``: False for an eager one."""
    if variant not in COMPILE:
        return False
    options = COMPILE[variant] | ({} if backend == "inductor" else {"backend": backend})
    return options or True


def speedups(results: list[Result]) -> dict[tuple[str, str], float]:
    """Median samples/s of each compiled paratrain variant over eager paratrain's, per job."""
    eager = {r.job: r.median for r in results if r.variant == "paratrain" and r.speeds}
    return {(r.job, r.variant): r.median / eager[r.job] for r in results
            if r.variant in COMPILE and r.speeds and eager.get(r.job)}


def speedup_table(results: list[Result]) -> str:
    """The compiled variants against eager paratrain, one row each (empty: none ran)."""
    rows = [f"| {job} | {variant} | {ratio:.2f}x |"
            for (job, variant), ratio in speedups(results).items()]
    return "\n".join(["| job | variant | vs paratrain (eager) |", "|---|---|---:|", *rows]) \
        if rows else ""


def resident_mib() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return None



def fresh_device(device: torch.device) -> bool:
    """Forget an earlier variant's compiled code and peak memory; whether it is CUDA.

    Compiled code (and the memory pools of its CUDA graphs) from an earlier variant
    would otherwise stay alive and count in the next one's peak.
    """
    torch.compiler.reset()
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return cuda

def measure(variant: str, job: str, size: JobSize, dataset: TensorDataset,
            device: torch.device, *, precision: str, warmup: int, steps: int,
            backend: str = "inductor") -> tuple[float, float | None]:
    """Build ``variant`` afresh, warm it up, time ``steps`` steps: (samples/s, peak MiB)."""
    cuda = fresh_device(device)
    step, batches, cleanup = BUILDERS[variant](job, size, dataset, device, precision,
                                               compile_option(variant, backend))
    try:
        for _ in range(warmup):
            step(*next(batches))
        if cuda:
            torch.cuda.synchronize(device)
        started, samples = time.perf_counter(), 0
        for _ in range(steps):
            x, y = next(batches)
            step(x, y)
            samples += len(x)
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - started
        peak = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else resident_mib()
    finally:
        batches.close()
        cleanup()
    return samples / elapsed, peak


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accelerator", default="cuda", choices=("cpu", "cuda"))
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=JOBS)
    parser.add_argument("--variants", nargs="+", default=None,
                        help="default: every variant that applies to the accelerator")
    parser.add_argument("--repeats", type=int, default=None, help="default: 3 cuda, 2 cpu")
    parser.add_argument("--warmup", type=int, default=None, help="default: 10 cuda, 1 cpu")
    parser.add_argument("--steps", type=int, default=None, help="default: 50 cuda, 4 cpu")
    parser.add_argument("--batch-size", type=int, default=None, help="replaces every job's")
    parser.add_argument("--samples", type=int, default=None, help="dataset length, every job")
    parser.add_argument("--seq-len", type=int, default=None, help="gpt")
    parser.add_argument("--gpt-layers", type=int, default=None)
    parser.add_argument("--gpt-width", type=int, default=None, help="n_embd; heads of 64")
    parser.add_argument("--precision", default=None, choices=("32", "bf16-mixed"),
                        help="every job's; default: as named on cuda, 32 on cpu")
    parser.add_argument("--compile-on-cpu", action="store_true")
    parser.add_argument("--data-dir", default=None, help="Fashion-MNIST files")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the compiled variants (eager: plumbing)")
    parser.add_argument("--json", default=None, help="also write every repeat's numbers here")
    args = parser.parse_args(argv)
    cpu = args.accelerator == "cpu"
    for name, on_cpu, on_cuda in (("repeats", 2, 3), ("warmup", 1, 10), ("steps", 4, 50)):
        if getattr(args, name) is None:
            setattr(args, name, on_cpu if cpu else on_cuda)
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        parser.error("--accelerator cuda: no CUDA device here; use --accelerator cpu")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.accelerator)
    names = tuple(args.variants or variants(accelerator=args.accelerator,
                                            compile_on_cpu=args.compile_on_cpu))
    unknown = sorted(set(names) - set(BUILDERS))
    if unknown:
        raise SystemExit(f"unknown variant(s) {unknown}; choose from {sorted(BUILDERS)}")
    missing = [n for n in names if n in PEER_MODULES
               and importlib.util.find_spec(PEER_MODULES[n]) is None]
    for name in missing:
        print(f"skipping {name}: `{PEER_MODULES[name]}` is not installed "
              f"(pip install 'paratrain[bench]')")
    names = tuple(n for n in names if n not in missing)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {gpu}, torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"{args.repeats} repeats x {args.steps} steps after {args.warmup} warm-up")
    results: list[Result] = []
    for job in args.jobs:
        size = job_size(job, accelerator=args.accelerator, batch_size=args.batch_size,
                        samples=args.samples, seq_len=args.seq_len, n_layer=args.gpt_layers,
                        n_embd=args.gpt_width)
        precision = job_precision(job, accelerator=args.accelerator, override=args.precision)
        dataset = make_dataset(job, size, args.data_dir)
        print(f"{job}: {size}, {len(dataset)} samples, precision {precision}", flush=True)
        by_variant = {n: Result(job, n) for n in names}
        for repeat in range(args.repeats):
            for name in interleaved(names, repeat):
                speed, peak = measure(name, job, size, dataset, device, precision=precision,
                                      warmup=args.warmup, steps=args.steps,
                                      backend=args.compile_backend)
                by_variant[name].speeds.append(speed)
                by_variant[name].peaks_mib.append(peak)
                print(f"  repeat {repeat} {name:<22} {speed:10.1f} samples/s", flush=True)
        results.extend(by_variant.values())
    label = "peak MiB (CUDA max allocated)" if device.type == "cuda" else "RSS MiB after steps"
    print()
    print(markdown_table(results, memory_label=label))
    table = speedup_table(results)
    if table:
        print()
        print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": gpu, "torch": torch.__version__,
                       "rows": [{"job": r.job, "variant": r.variant, "speeds": r.speeds,
                                 "median": r.median if r.speeds else None,
                                 "peak_mib": r.peak_mib} for r in results],
                       "vs_paratrain": [{"job": j, "variant": v, "ratio": x}
                                        for (j, v), x in speedups(results).items()]},
                      f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
