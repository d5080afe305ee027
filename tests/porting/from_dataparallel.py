"""After porting from nn.DataParallel (docs/porting.md): a paratrain Run."""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import paratrain

sys.path.insert(0, str(Path(__file__).parent))
from _common import dataset, fingerprint, model  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    args = parser.parse_args(argv)
    with paratrain.Run(progress=False, accelerator="cpu") as run:   # was: model = nn.DataParallel(model)
        net = model()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        net, optimizer = run.prepare(net, optimizer)
        loader = run.loader(dataset(), batch_size=args.batch_size)
        for _ in run.epochs(2):
            for x, y in loader:                     # batches already on run.device
                loss = F.cross_entropy(net(x), y)
                run.backward(loss)                  # was: loss.backward()
                run.step(optimizer)                 # was: optimizer.step(); optimizer.zero_grad()
        print(f"rank {run.rank}/{run.world_size} fingerprint {fingerprint(run.strategy.unwrap(net)):.6f}")
        return fingerprint(run.strategy.unwrap(net))


if __name__ == "__main__":
    main()
