"""A small paratrain training used by the end-to-end tests (dropout exercises the RNG)."""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--checkpoint-dir", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with paratrain.Run(strategy=args.strategy, seed=5, progress=False, accelerator="cpu",
                       checkpoint_dir=args.checkpoint_dir,
                       checkpoint_every=args.checkpoint_every) as run:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(200, 6, generator=g), torch.randint(0, 4, (200,), generator=g))
        model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Dropout(0.25), nn.Linear(32, 4))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        model, optimizer = run.prepare(model, optimizer)
        loader = run.loader(data, batch_size=args.batch_size)
        for epoch in run.epochs(args.epochs):
            for x, y in loader:
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
            run.print(f"epoch {epoch} step {run.global_step}")
        if run.is_main:
            torch.save(run.strategy.unwrap(model).state_dict(), args.out)


if __name__ == "__main__":
    main()
