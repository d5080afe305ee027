"""Parameter server under a straggler: sync, ssp(s=2), async and ddp side by side.

1 server + 3 workers (ddp: 3 workers) train the demo ConvNet on Fashion-MNIST
until the workers together have processed the same number of samples; one
worker is made 2x slower with ``PARATRAIN_STRAGGLER`` (its extra sleep per step
equals the step time measured here in one process). Prints samples/s and test
accuracy of each mode, and ratios to sync.

    python benchmarks/ps_straggler.py                      # full size
    python benchmarks/ps_straggler.py --samples 3072 --test-samples 1000   # quick

Each mode is one ``paratrain launch`` job; this script re-enters itself with
``--train`` inside the job.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import Subset

MODES = {"sync": {"mode": "sync"}, "ssp": {"mode": "ssp", "staleness": 2},
         "async": {"mode": "async"}, "ddp": None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--samples", type=int, default=12288, help="training samples, all workers together")
    add("--batch-size", type=int, default=32, help="per worker")
    add("--workers", type=int, default=3)
    add("--slowdown", type=float, default=2.0, help="the straggler's step time, in step times")
    add("--test-samples", type=int, default=10000)
    add("--lr", type=float, default=1e-3)
    add("--modes", default="sync,ssp,async,ddp")
    add("--train", action="store_true", help=argparse.SUPPRESS)
    add("--mode", default="sync", help=argparse.SUPPRESS)
    add("--json", default=None, help=argparse.SUPPRESS)
    return parser


def train(args: argparse.Namespace) -> None:
    """One job (inside ``paratrain launch``): train to the sample budget, evaluate."""
    import paratrain
    from paratrain.datasets import fashion_mnist
    from paratrain.demo import convnet

    options = MODES[args.mode]
    with paratrain.Run(strategy="ddp" if options is None else "ps", strategy_options=options or {},
                       seed=0, progress=False, accelerator="cpu") as run:
        train_set = fashion_mnist("train", limit=args.samples)
        test_set = fashion_mnist("test")
        model = convnet()
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
        model, optimizer = run.prepare(model, optimizer)  # a server serves inside, then exits
        loader = run.loader(train_set, batch_size=args.batch_size)
        per_step = args.batch_size
        is_ps = options is not None
        steps, processed, start = 0, 0, time.perf_counter()
        for _ in run.epochs(10_000):
            for x, y in loader:
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
                steps += 1
                # Global samples: async workers step at their own pace, so ask the
                # servers (every 4 steps); otherwise every worker takes the same steps.
                if args.mode == "async" and is_ps:
                    if steps % 4 == 0:
                        processed = run.strategy.stats().pushes * per_step
                else:
                    processed = steps * run.strategy.data_parallel_size * per_step
                if processed >= args.samples:
                    break
            if processed >= args.samples:
                break
        run.mean(torch.tensor(0.0))  # every worker done (and, for ps, holds the final model)
        seconds = time.perf_counter() - start
        if is_ps:
            processed = run.strategy.stats().pushes * per_step
        test = run.eval_loader(Subset(test_set, range(min(args.test_samples, len(test_set)))),
                               batch_size=500)
        result = run.evaluate(model, test)
        summary = {"mode": args.mode, "samples": processed, "seconds": seconds,
                   "samples_per_s": processed / seconds, "accuracy": result["accuracy"],
                   "rank0_steps": steps}
        if is_ps:
            stats = run.strategy.stats()
            summary["max_staleness"] = stats.max_staleness
        if run.is_main and args.json:
            Path(args.json).write_text(json.dumps(summary))


def step_time(batch_size: int) -> float:
    """Seconds of one forward+backward+Adam step of the ConvNet on one thread."""
    from paratrain.demo import convnet

    torch.set_num_threads(1)
    model = convnet()
    optimizer = torch.optim.Adam(model.parameters())
    x, y = torch.randn(batch_size, 1, 28, 28), torch.randint(0, 10, (batch_size,))
    times = []
    for _ in range(8):
        t0 = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    return sorted(times[2:])[len(times[2:]) // 2]


def main() -> int:
    args = build_parser().parse_args()
    if args.train:
        train(args)
        return 0
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"ps_straggler: unknown mode(s) {unknown}; choose from {list(MODES)}",
              file=sys.stderr)
        return 2
    delay = (args.slowdown - 1.0) * step_time(args.batch_size)
    straggler = args.workers - 1  # a worker rank in both layouts
    print(f"{args.workers} workers (+1 server for ps), batch {args.batch_size}/worker, "
          f"{args.samples} samples, worker rank {straggler} sleeps {delay * 1e3:.1f} ms/step")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            out = Path(tmp) / f"{mode}.json"
            nproc = args.workers + (0 if MODES[mode] is None else 1)
            argv = [sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node",
                    str(nproc), *([] if MODES[mode] is None else ["--ps-servers", "1"]),
                    __file__, "--train", "--mode", mode, "--json", str(out),
                    "--samples", str(args.samples), "--batch-size", str(args.batch_size),
                    "--test-samples", str(args.test_samples), "--lr", str(args.lr)]
            env = {**os.environ, "PARATRAIN_STRAGGLER": f"{straggler}:{delay:.4f}",
                   "OMP_NUM_THREADS": "1"}
            job = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
            if job.returncode != 0:
                print(f"{mode}: failed\n{job.stderr[-2000:]}", file=sys.stderr)
                return 1
            results[mode] = json.loads(out.read_text())
    base = results.get("sync")
    print("\n| mode | samples | seconds | samples/s | vs sync | test accuracy | vs sync (points) "
          "| max staleness |\n|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        diff = f"{100 * (r['accuracy'] - base['accuracy']):+.1f}" if base else "-"
        label = "ssp(s=2)" if mode == "ssp" else mode
        print(f"| {label} | {r['samples']} | {r['seconds']:.1f} | {r['samples_per_s']:.0f} | "
              f"{ratio} | {r['accuracy']:.4f} | {diff} | {r.get('max_staleness', '-')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
