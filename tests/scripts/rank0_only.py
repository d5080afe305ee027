"""Calls one collective ``Run`` method on rank 0 only, as ``--method`` says; the other ranks
finish the script (with ``--close``: call ``run.close()`` first)."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import paratrain


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--method", choices=["save", "evaluate", "mean"], required=True)
    parser.add_argument("--close", action="store_true")
    parser.add_argument("--checkpoint-dir")
    args = parser.parse_args()
    run = paratrain.Run(strategy="ddp", accelerator="cpu", progress=False, timeout_s=60,
                        checkpoint_dir=args.checkpoint_dir)
    model = nn.Linear(4, 3)
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    run.backward(F.cross_entropy(model(x), y))
    run.step(optimizer)
    if run.is_main:
        if args.method == "save":
            run.save()
        elif args.method == "evaluate":
            print(run.evaluate(model, [(x, y)]))
        else:
            print(run.mean(1.0))
    if args.close:
        run.close()


if __name__ == "__main__":
    main()
