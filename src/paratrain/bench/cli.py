"""The ``paratrain bench`` command line: flags in, a table (and JSON) out."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from paratrain.bench.layouts import split_rows
from paratrain.bench.rows import ACCELERATORS
from paratrain.bench.runner import BenchConfig, bench
from paratrain.bench.worker import DEMO_MODEL, OPTIMIZERS

__all__ = ["build_parser", "main"]


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise ValueError(f"{flag}: expected positive integers such as 1,2, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paratrain bench", description=__doc__.splitlines()[0])
    add = p.add_argument
    add("model", nargs="?", default=None,
        help=f"MODULE:CALLABLE returning an nn.Module (default {DEMO_MODEL}; with cp or ep "
             "rows the bench's GPT, paratrain.bench.layouts:gpt or :gpt_moe)")
    add("--input-shape", default=None,
        help="shape of one sample (default 1,28,28; 64 for the token workloads)")
    add("--vocab-size", type=int, default=None,
        help="token inputs below this (a language model; default: the token workloads' own)")
    add("--strategies", default=None,
        help="comma-separated STRATEGY, STRATEGY+PRECISION or a layout of degrees such as "
             "cp=2 or 'dp_shard=2,cp=2' (separate two layouts with ';': 'cp=2;ep=2') "
             "(default: on CUDA single,ddp,ddp+bf16-mixed,fsdp,dp; on CPU all registered)")
    add("--precision", default="32",
        help="comma-separated precisions for strategies named without one (default 32)")
    add("--accelerator", choices=ACCELERATORS, default="auto",
        help="auto: CUDA when visible (default), cpu or cuda")
    add("--world-sizes", default=None,
        help="training processes per run (default: 1,2 on CPU; 1 and the GPU count on CUDA)")
    add("--batch-size", type=int, default=32, help="per process (default 32)")
    add("--warmup", type=int, default=3, help="untimed steps per phase (default 3)")
    add("--steps", type=int, default=10, help="steps per timed window (default 10)")
    add("--repeats", type=int, default=3, help="timed windows (default 3)")
    add("--optimizer", choices=OPTIMIZERS, default="adam")
    add("--epoch-samples", type=int, default=60_000, help="for seconds/epoch (default 60000)")
    add("--threads", type=int, default=None, help="OMP threads per process")
    add("--timeout", type=float, default=600.0, help="seconds per configuration (default 600)")
    add("--link-probe", type=int, default=0, metavar="BYTES",
        help="also time all-reduces of BYTES to report link bandwidth")
    add("--json", metavar="PATH", help="write the report as JSON")
    add("--csv", metavar="PATH", help="write the rows as CSV")
    add("--png", metavar="PATH", help="plot throughput and memory (needs matplotlib)")
    add("--workdir", metavar="DIR", help="keep per-job files (spec, rank JSON, logs) here")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``paratrain bench``; 2 with one line on bad input."""
    args = build_parser().parse_args(argv)
    # MODULE:CALLABLE in the current folder, as promised: the console script's sys.path[0] is
    # its own folder, not the working directory (the workers get it through PYTHONPATH).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        strategies = None if args.strategies is None else tuple(split_rows(args.strategies))
        world_sizes = None if args.world_sizes is None else _ints(args.world_sizes, "--world-sizes")
        config = BenchConfig(
            model=args.model, vocab_size=args.vocab_size,
            input_shape=None if args.input_shape is None else _ints(args.input_shape,
                                                                    "--input-shape"),
            strategies=strategies, precisions=tuple(args.precision.split(",")),
            accelerator=args.accelerator, world_sizes=world_sizes,
            batch_size=args.batch_size, warmup_steps=args.warmup, steps=args.steps,
            repeats=args.repeats, optimizer=args.optimizer, epoch_samples=args.epoch_samples,
            threads=args.threads, timeout_s=args.timeout, link_probe_bytes=args.link_probe)
        for flag, path in (("--json", args.json), ("--csv", args.csv), ("--png", args.png)):
            if path and not Path(path).resolve().parent.is_dir():
                raise ValueError(f"{flag}: directory of {path!r} does not exist")
        if args.png:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                raise ValueError("--png needs matplotlib: pip install 'paratrain[plots]'") from None
        report = bench(config, workdir=args.workdir)
    except ValueError as exc:
        print(f"paratrain bench: error: {exc}", file=sys.stderr)
        return 2
    print(report.format_table())
    if args.json:
        report.write_json(args.json)
    if args.csv:
        report.write_csv(args.csv)
    if args.png:
        report.plot(args.png)
    failed = [r for r in report.rows if r.status == "failed"]
    return 1 if failed and len(failed) == len(report.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
