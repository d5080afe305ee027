"""Minimal torch.distributed check: all_reduce(rank + 1) over gloo must give the sum 1..world."""

import os
import socket

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert t.item() == expected, f"rank {rank}: all_reduce gave {t.item()}, expected {expected}"
    print(
        f"allreduce ok rank={rank} world={world} sum={t.item():g} "
        f"host={socket.gethostname()} master={os.environ.get('MASTER_ADDR')}:"
        f"{os.environ.get('MASTER_PORT')} ifname={os.environ.get('GLOO_SOCKET_IFNAME')}",
        flush=True,
    )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
