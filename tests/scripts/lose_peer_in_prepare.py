"""Rank 1 dies (SIGKILL) after Run() and before prepare(): rank 0's prepare() loses it."""

import os
import signal

import torch
from torch import nn

import paratrain


def main():
    with paratrain.Run(strategy="ddp", accelerator="cpu", progress=False, timeout_s=20) as run:
        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if run.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        run.prepare(model, optimizer)  # DDP broadcasts the parameters from rank 0
        print("prepared", flush=True)


if __name__ == "__main__":
    main()
