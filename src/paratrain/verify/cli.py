"""The ``paratrain verify`` command line: flags in, a verdict per layout out."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from paratrain.distributed.spawn import WorkerFailed
from paratrain.settings import Settings
from paratrain.verify.probe import (
    Factorization,
    ProbeSetup,
    resolve_accelerator,
)
from paratrain.verify.replay import verify_replay
from paratrain.verify.resume import verify_resume
from paratrain.verify.runner import (
    DEFAULT_FACTORIZATIONS,
    check_tolerance,
    parse_factorizations,
    verify,
)

__all__ = ["build_parser", "main"]

RESUME_FACTORIZATION = "2x4x1"


def _resolve(spec: str, option: str) -> Any:
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ValueError(f"{option} must be MODULE:FUNCTION, got {spec!r}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"{option} {spec!r} cannot be imported ({exc}); run from the folder "
                         "that holds the module or add it to PYTHONPATH") from None


def _options(text: str) -> dict[str, Any]:
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--strategy-options must be a JSON object, got {text!r} ({exc.msg}); "
                         "e.g. '{\"split_points\": [2]}'") from None
    if not isinstance(options, dict):
        raise ValueError(f"--strategy-options must be a JSON object, got {text!r}")
    # JSON has no tuples; options such as split_points are declared as tuples.
    return {k: tuple(v) if isinstance(v, list) else v for k, v in options.items()}


def _resume_factorizations(args: argparse.Namespace) -> list[Factorization]:
    """--resume (and --replay) check each factorization on its own: no reference, no shared
    global batch."""
    flag, what = (("--replay", "a replayed step must equal the first run") if args.replay
                  else ("--resume", "a resumed run must equal the uninterrupted one"))
    if args.resume and args.replay:
        raise ValueError("--resume and --replay are separate checks; give one of them")
    if args.tolerance is not None:
        raise ValueError(f"--tolerance does not apply to {flag}: {what} bitwise; "
                         "leave --tolerance out")
    if args.no_dropout:
        raise ValueError(f"--no-dropout does not apply to {flag}: dropout must {flag[2:]} "
                         "exactly too; leave --no-dropout out")
    items = (args.factorizations or RESUME_FACTORIZATION).split(",")
    return list(dict.fromkeys(Factorization.parse(item) for item in items))


def _one_line(exc: WorkerFailed) -> str:
    """``rank 0 raised ValueError: ...``: the rank and its error, not the traceback
    (``PARATRAIN_TRACEBACK=1`` keeps it all)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    if Settings.from_environ().show_traceback or len(lines) < 2:
        return str(exc)
    return f"{lines[0].rstrip(':')} {lines[-1].strip()}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="paratrain verify", description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--factorizations", default=None,
        help="comma-separated WORLDxMICROxACCUM with one global batch (default "
             f"{','.join(DEFAULT_FACTORIZATIONS)}; with --resume or --replay "
             f"{RESUME_FACTORIZATION})")
    add("--steps", type=int, default=3,
        help="optimizer steps per probe (with --resume: steps before the checkpoint)")
    add("--resume", action="store_true",
        help="check instead that a run stopped after --steps steps and resumed from its "
             "checkpoint continues bitwise equal to an uninterrupted run")
    add("--replay", action="store_true",
        help="check instead that --steps steps trained twice give bitwise equal digests of "
             "losses, gradients, buffers and parameters, and that replicas agree across ranks")
    add("--tolerance", type=float, default=None, help="max relative difference (default by precision)")
    add("--precision", default="32")
    add("--accelerator", default="auto",
        help="auto (CUDA when every process can have a GPU, default), cpu or cuda")
    add("--strategy", default="ddp", help="strategy for multi-process factorizations")
    add("--strategy-options", default="{}", metavar="JSON",
        help='its options as a JSON object, e.g. \'{"split_points": [2]}\'')
    add("--lr", type=float, default=0.05)
    add("--seed", type=int, default=0)
    add("--model", default=None, metavar="MODULE:FN", help="model factory (default: demo ConvNet)")
    add("--data", default=None, metavar="MODULE:FN", help="dataset factory (default: Fashion-MNIST)")
    add("--loader", default=None, metavar="MODULE:FN", help="loader_fn(run, dataset, micro_batch)")
    add("--step", default=None, metavar="MODULE:FN", help="step_fn(run, model, batch)")
    add("--no-dropout", action="store_true", help="turn dropout off in every probe")
    add("--timeout", type=float, default=120.0, help="seconds per multi-process probe")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``paratrain verify``: print the report; exit 1 if a factorization is flagged (or,
    with ``--resume``, if a resumed run differs; with ``--replay``, if a digest differs)."""
    args = build_parser().parse_args(argv)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # MODULE:FN in the current folder
    try:
        # Every argument is checked before any data is read: a bad one fails at once, with
        # its own message, whether or not the dataset is there.
        fields: dict[str, Any] = {}
        for option, name in (("model", "model_fn"), ("data", "data_fn"),
                             ("loader", "loader_fn"), ("step", "step_fn")):
            if getattr(args, option):
                fields[name] = _resolve(getattr(args, option), f"--{option}")
        setup = ProbeSetup(num_steps=args.steps, lr=args.lr, seed=args.seed,
                           precision=args.precision, strategy=args.strategy,
                           strategy_options=_options(args.strategy_options),
                           accelerator=args.accelerator,
                           timeout_s=args.timeout, **fields)
        if args.resume or args.replay:
            factorizations = _resume_factorizations(args)
        else:
            factorizations = parse_factorizations(
                (args.factorizations or ",".join(DEFAULT_FACTORIZATIONS)).split(","))
            check_tolerance(setup, args.tolerance)
        resolve_accelerator(setup.accelerator, factorizations)
        if "data_fn" not in fields:
            from paratrain.datasets.images import find_fashion_mnist

            find_fashion_mnist()
        if args.resume:
            report = verify_resume(setup, factorizations=factorizations)
        elif args.replay:
            report = verify_replay(setup, factorizations=factorizations)
        else:
            report = verify(setup, factorizations=factorizations, tolerance=args.tolerance,
                            no_dropout=args.no_dropout)
    except (ValueError, FileNotFoundError) as exc:
        print(f"paratrain verify: {exc}", file=sys.stderr)
        return 2
    except WorkerFailed as exc:
        print(f"paratrain verify: a multi-process probe failed: {_one_line(exc)}",
              file=sys.stderr)
        return 2
    print(report.format())
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
