"""A small paratrain training for fault, restart and bad-input tests.

Prints ``step N`` after every optimizer step (with ``--log-steps``) so a test
can act mid-run, and saves the final parameters with ``--out``.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain


def main():
    parser = argparse.ArgumentParser()
    add = parser.add_argument
    add("--strategy", default="auto")
    add("--precision", default="32")
    add("--epochs", type=int, default=2)
    add("--batch-size", type=int, default=8)
    add("--num-samples", type=int, default=200)
    add("--hidden", type=int, default=32)
    add("--seed", type=int, default=5)
    add("--checkpoint-dir", default=None)
    add("--checkpoint-every", type=int, default=None)
    add("--step-sleep", type=float, default=0.0, help="seconds to sleep after each step")
    add("--log-steps", action="store_true")
    add("--out", default=None)
    args = parser.parse_args()
    with paratrain.Run(strategy=args.strategy, precision=args.precision, seed=args.seed,
                       progress=False, accelerator="cpu", checkpoint_dir=args.checkpoint_dir,
                       checkpoint_every=args.checkpoint_every) as run:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(args.num_samples, 6, generator=g),
                             torch.randint(0, 4, (args.num_samples,), generator=g))
        model = nn.Sequential(nn.Linear(6, args.hidden), nn.ReLU(), nn.Dropout(0.25),
                              nn.Linear(args.hidden, 4))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = run.prepare(model, optimizer)
        loader = run.loader(data, batch_size=args.batch_size)
        for epoch in run.epochs(args.epochs):
            for x, y in loader:
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
                if args.log_steps:
                    print(f"step {run.global_step} rank {run.rank}", flush=True)
                if args.step_sleep:
                    time.sleep(args.step_sleep)
            run.print(f"epoch {epoch} step {run.global_step}")
        if run.is_main and args.out:
            torch.save(run.strategy.unwrap(model).state_dict(), args.out)


if __name__ == "__main__":
    main()
