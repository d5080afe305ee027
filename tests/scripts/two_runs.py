"""Trains one step under each strategy named on the command line, one ``Run`` after another
in the same process (``Run(...)`` ... ``run.close()``, then the next)."""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import paratrain


def main():
    for index, strategy in enumerate(sys.argv[1:]):
        run = paratrain.Run(strategy=strategy, accelerator="cpu", progress=False, timeout_s=30)
        torch.manual_seed(0)
        model = nn.Linear(4, 3)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = run.prepare(model, optimizer)
        x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
        run.backward(F.cross_entropy(model(x), y))
        run.step(optimizer)
        print(f"run {index} {strategy} rank {run.rank} done", flush=True)
        run.close()


if __name__ == "__main__":
    main()
