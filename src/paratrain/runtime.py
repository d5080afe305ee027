"""Process-group lifetime: initialise once with a timeout, tear down in the right order."""

from __future__ import annotations

import datetime
import gc
import os
import sys

import torch
import torch.distributed as dist

from paratrain.topology import Topology


def init_process_group(topology: Topology, *, timeout_s: float) -> bool:
    """Create the default process group for ``topology``; return True if this call created it.

    A single process needs no group. When the launcher already initialised one
    (a user script that called ``init_process_group`` itself) it is reused. When
    processes share GPUs (``topology.shares_device``), rank 0 prints one notice.
    """
    if not topology.is_distributed or dist.is_initialized():
        return False
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not os.environ.get(name):
            raise RuntimeError(
                f"{name} is not set for a {topology.world_size}-process job; "
                "start it with `paratrain launch` (or set MASTER_ADDR and MASTER_PORT)"
            )
    kwargs = {}
    if topology.device.type == "cuda":
        torch.cuda.set_device(topology.device)
    if topology.backend == "nccl":
        # Binding the group to the device lets NCCL create its communicator eagerly.
        kwargs["device_id"] = topology.device
    if topology.is_main and topology.notice:
        print(f"paratrain: {topology.notice}", file=sys.stderr, flush=True)
    dist.init_process_group(
        backend=topology.backend,
        init_method="env://",
        rank=topology.rank,
        world_size=topology.world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
        **kwargs,
    )
    return True


def destroy_process_group() -> None:
    """Destroy the default group after everything that holds it is gone.

    DDP reducers keep a reference to the group; if one outlives the group it is
    torn down during interpreter shutdown, which intermittently aborted the
    process (``terminate called without an active exception``). Callers release
    their wrapped modules first; ``gc.collect()`` here frees cycles that still
    hold one.
    """
    if not dist.is_initialized():
        return
    gc.collect()
    dist.destroy_process_group()
