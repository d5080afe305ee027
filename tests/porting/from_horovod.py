"""A Horovod training script; the only change is the import (docs/porting.md)."""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import paratrain.horovod as hvd  # was: import horovod.torch as hvd

sys.path.insert(0, str(Path(__file__).parent))
from _common import dataset, fingerprint, model  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=4, help="per process and backward pass")
    parser.add_argument("--passes", type=int, default=2, help="backward_passes_per_step")
    args = parser.parse_args(argv)

    hvd.init()
    torch.set_num_threads(1)
    net = model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters(),
                                         compression=hvd.Compression.none,
                                         backward_passes_per_step=args.passes)
    hvd.broadcast_parameters(net.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    x, y = dataset().tensors
    # Horovod scripts shard the data themselves (usually with a DistributedSampler).
    x, y = x[hvd.rank()::hvd.size()], y[hvd.rank()::hvd.size()]
    per_step = args.batch_size * args.passes
    for epoch in range(2):
        for start in range(0, len(x) - per_step + 1, per_step):
            optimizer.zero_grad()
            for p in range(args.passes):
                i = start + p * args.batch_size
                loss = F.cross_entropy(net(x[i:i + args.batch_size]), y[i:i + args.batch_size])
                (loss / args.passes).backward()
            optimizer.step()
        mean_loss = hvd.allreduce(loss.detach(), name="loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch} loss {mean_loss.item():.4f}")
    value = fingerprint(net)
    print(f"rank {hvd.rank()}/{hvd.size()} fingerprint {value:.6f}")
    return value


if __name__ == "__main__":
    main()
