"""After porting a raw DDP + torchrun script (docs/porting.md): a paratrain Run."""

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
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args(argv)
    # Replaces init_process_group, LOCAL_RANK parsing, set_device, DDP(...), DistributedSampler
    # and destroy_process_group.
    with paratrain.Run(strategy="ddp", progress=False, seed=0) as run:
        net = model()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        net, optimizer = run.prepare(net, optimizer)
        loader = run.loader(dataset(), batch_size=args.batch_size)
        for epoch in run.epochs(args.epochs):       # replaces sampler.set_epoch(epoch)
            for x, y in loader:
                loss = F.cross_entropy(net(x), y)
                run.backward(loss)
                run.step(optimizer)
            run.print(f"epoch {epoch} loss {run.mean(loss):.4f}")   # rank 0 prints
        value = fingerprint(run.strategy.unwrap(net))
        print(f"rank {run.rank}/{run.world_size} fingerprint {value:.6f}")
        return value


if __name__ == "__main__":
    main()
