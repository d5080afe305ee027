"""Parameter server under a straggler: sync, ssp(s=2), async and ddp side by side.

1 server + 3 workers (ddp: 3 workers) train the demo ConvNet on Fashion-MNIST
until the workers together have processed the same number of samples (default:
one epoch). Prints samples/s and test accuracy of each mode, and ratios to sync,
for each scenario:

``cpu``
    Real compute only; worker rank 2 sleeps one step time ``T`` (measured here
    in one process) after every step, so it is 2x slower. On a machine with
    fewer cores than processes the workers also compete for the CPU.
``device``
    As on accelerators: every worker also waits ``D = --device-factor x T`` per
    step with the CPU free (an emulated device's compute), and the straggler
    sleeps ``T + D`` more. Workers no longer compete for cores.
``jitter``
    ``device``, but instead of one fixed straggler every worker is slowed by
    ``T + D`` with probability 1/3 per step: the same average delay, moving
    between workers. The case bounded staleness is for: with one *constant*
    straggler ssp runs at the straggler's pace once the others are ``s`` steps
    ahead, so its throughput equals sync's.

    python benchmarks/ps_straggler.py                      # all scenarios, ~15 min
    python benchmarks/ps_straggler.py --scenarios cpu --samples 3072 --test-samples 1000

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
         "ssp-inverse": {"mode": "ssp", "staleness": 2, "staleness_weighting": "inverse"},
         "async": {"mode": "async"}, "ddp": None}
LABELS = {"ssp": "ssp(s=2)", "ssp-inverse": "ssp(s=2), inverse weights"}
SCENARIOS = ("cpu", "device", "jitter")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--samples", type=int, default=60000, help="training samples, all workers together")
    add("--batch-size", type=int, default=32, help="per worker")
    add("--workers", type=int, default=3)
    add("--slowdown", type=float, default=2.0, help="the straggler's step time, in step times")
    add("--test-samples", type=int, default=10000)
    add("--lr", type=float, default=1e-3)
    add("--modes", default="sync,ssp,ssp-inverse,async,ddp")
    add("--scenarios", default=",".join(SCENARIOS))
    add("--device-factor", type=float, default=2.0,
        help="device and jitter scenarios: emulated device time per step, in step times T")
    add("--train", action="store_true", help=argparse.SUPPRESS)
    add("--device-s", type=float, default=0.0, help=argparse.SUPPRESS)
    add("--mode", default="sync", help=argparse.SUPPRESS)
    add("--json", default=None, help=argparse.SUPPRESS)
    return parser


def train(args: argparse.Namespace) -> None:
    """One job (inside ``paratrain launch``): train to the sample budget, evaluate."""
    import paratrain
    from paratrain.datasets.images import fashion_mnist
    from paratrain.models import convnet

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
                if args.device_s:
                    time.sleep(args.device_s)  # the emulated device computes; the CPU is free
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
    from paratrain.models import convnet

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
    scenarios = args.scenarios.split(",")
    if unknown := [s for s in scenarios if s not in SCENARIOS]:
        print(f"ps_straggler: unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}",
              file=sys.stderr)
        return 2
    step = step_time(args.batch_size)
    print(f"{args.workers} workers (+1 server for ps), batch {args.batch_size}/worker, "
          f"{args.samples} samples, step time T = {step * 1e3:.1f} ms (one process)")
    for scenario in scenarios:
        results = run_scenario(args, scenario, modes, step)
        if results is None:
            return 1
        print_table(scenario, results)
    return 0


def run_scenario(args: argparse.Namespace, scenario: str, modes: list[str],
                 step: float) -> dict[str, dict] | None:
    device = 0.0 if scenario == "cpu" else args.device_factor * step
    delay = (args.slowdown - 1.0) * (step + device)
    straggler = args.workers - 1  # a worker rank in both layouts
    if scenario == "jitter":
        # Every worker, slowed with probability 1/W: on average one slow step per step.
        pattern = f"*:{delay:.4f}:{1 / args.workers:.4f}"
        print(f"\n[{scenario}] device time {device * 1e3:.1f} ms/step; every worker sleeps "
              f"{delay * 1e3:.1f} ms after a step with probability 1/{args.workers}", flush=True)
    else:
        pattern = f"{straggler}:{delay:.4f}"
        print(f"\n[{scenario}] device time {device * 1e3:.1f} ms/step; worker rank {straggler} "
              f"sleeps {delay * 1e3:.1f} ms after every step", flush=True)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in modes:
            out = Path(tmp) / f"{mode}.json"
            nproc = args.workers + (0 if MODES[mode] is None else 1)
            argv = [sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node",
                    str(nproc), *([] if MODES[mode] is None else ["--ps-servers", "1"]),
                    __file__, "--train", "--mode", mode, "--json", str(out),
                    "--samples", str(args.samples), "--batch-size", str(args.batch_size),
                    "--test-samples", str(args.test_samples), "--lr", str(args.lr),
                    "--device-s", f"{device:.4f}"]
            # The server rank is never slowed ("*" reaches it, but it never steps).
            env = {**os.environ, "PARATRAIN_STRAGGLER": pattern, "OMP_NUM_THREADS": "1"}
            job = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
            if job.returncode != 0:
                print(f"{scenario}/{mode}: failed\n{job.stderr[-2000:]}", file=sys.stderr)
                return None
            results[mode] = json.loads(out.read_text())
    return results


def print_table(scenario: str, results: dict[str, dict]) -> None:
    base = results.get("sync")
    print(f"\n{scenario}:\n\n| mode | samples | seconds | samples/s | vs sync | test accuracy "
          "| vs sync (points) | max staleness |\n|---|---|---|---|---|---|---|---|")
    for mode, r in results.items():
        ratio = f"{r['samples_per_s'] / base['samples_per_s']:.2f}x" if base else "-"
        diff = f"{100 * (r['accuracy'] - base['accuracy']):+.1f}" if base else "-"
        label = LABELS.get(mode, mode)
        print(f"| {label} | {r['samples']} | {r['seconds']:.1f} | {r['samples_per_s']:.0f} | "
              f"{ratio} | {r['accuracy']:.4f} | {diff} | {r.get('max_staleness', '-')} |",
              flush=True)


if __name__ == "__main__":
    sys.exit(main())
