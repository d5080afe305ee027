"""paratrain DDP vs a hand-written PyTorch DDP loop: same job, same launcher, interleaved.

    python benchmarks/overhead.py --repeats 5 --nproc 2

Each repeat launches both variants through `paratrain launch` (alternating which
goes first, so drift in machine load hits both alike) and records the samples/s
of the timed epoch. Prints per-repeat paired ratios and the median and spread.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

JOB = Path(__file__).with_name("overhead_job.py")


def launch(variant: str, args: argparse.Namespace, out: Path) -> float:
    cmd = [sys.executable, "-m", "paratrain.cli", "launch", "--nproc-per-node", str(args.nproc),
           str(JOB), "--variant", variant, "--samples", str(args.samples),
           "--epochs", str(args.epochs), "--json", str(out)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    return json.loads(out.read_text())["samples_per_s"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--samples", type=int, default=12_800)
    parser.add_argument("--epochs", type=int, default=2, help="all but the last are warm-up")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"paratrain": [], "raw": []}
    ratios = []
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = ["paratrain", "raw"] if repeat % 2 == 0 else ["raw", "paratrain"]
            speeds = {v: launch(v, args, Path(tmp) / f"{v}-{repeat}.json") for v in order}
            for variant, speed in speeds.items():
                results[variant].append(speed)
            ratios.append(speeds["paratrain"] / speeds["raw"])
            print(f"repeat {repeat}: paratrain {speeds['paratrain']:8.1f}  raw "
                  f"{speeds['raw']:8.1f} samples/s  ratio {ratios[-1]:.3f}", flush=True)
    print()
    print(f"{'variant':<10} {'median samples/s':>17} {'min':>9} {'max':>9}")
    for variant, speeds in results.items():
        print(f"{variant:<10} {statistics.median(speeds):17.1f} {min(speeds):9.1f} "
              f"{max(speeds):9.1f}")
    median_ratio = statistics.median(ratios)
    print(f"\npaired ratio paratrain/raw: median {median_ratio:.3f}, "
          f"min {min(ratios):.3f}, max {max(ratios):.3f} over {len(ratios)} repeats")
    return 0


if __name__ == "__main__":
    sys.exit(main())
