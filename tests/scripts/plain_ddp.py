"""A plain torchrun-style DDP script that knows nothing of paratrain."""

import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert int(os.environ["LOCAL_RANK"]) == rank
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.full((2, 4), float(rank + 1))
    model(x).sum().backward()
    opt.step()
    w = model.module.weight.detach().clone()
    gathered = [torch.empty_like(w) for _ in range(world)]
    dist.all_gather(gathered, w)
    assert all(torch.equal(g, w) for g in gathered)
    print(f"plain ddp rank {rank}/{world} ok threads={torch.get_num_threads()}", flush=True)
    # DDP's reducer holds the process group from inside a reference cycle; left to
    # interpreter shutdown, gloo's threads are torn down there and the process can
    # abort ("terminate called without an active exception"). Free it first.
    del model, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
