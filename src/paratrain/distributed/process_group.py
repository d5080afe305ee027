"""Process-group lifetime: initialise once with a timeout, tear down in the right order.

While the ranks gather in :func:`init_process_group` a rank that waits longer
than a few seconds says so every ``PARATRAIN_WAIT_REPORT_S`` (30 s), and a
rank that never comes ends the wait with one line instead of torch's
``DistStoreError`` traceback.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys

import torch
import torch.distributed as dist

from paratrain.distributed.topology import Topology
from paratrain.reliability import waits

_TIMEOUT_SETTINGS = "Run(timeout_s=...) or PARATRAIN_TIMEOUT_S sets the wait"


def init_process_group(topology: Topology, *, timeout_s: float,
                       wait_report_s: float = 30.0) -> bool:
    """Create the default process group for ``topology``; return True if this call created it.

    A single process needs no group. When the launcher already initialised one
    (a user script that called ``init_process_group`` itself) it is reused. When
    processes share GPUs (``topology.shares_device``), rank 0 prints one notice. While
    ranks are missing a notice comes every ``wait_report_s`` (``PARATRAIN_WAIT_REPORT_S``).
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
    others = topology.world_size - 1

    def waiting(elapsed: float) -> str:
        return (f"paratrain: rank {topology.rank}: waiting for the other {others} rank(s) to "
                f"join the process group ({elapsed:.0f} s so far, fails in "
                f"{max(0.0, timeout_s - elapsed):.0f} s; {_TIMEOUT_SETTINGS})")

    # Until every rank arrives (one stuck in its own set-up, or started late) this
    # blocks for up to timeout_s without a word.
    with waits.reporting(waiting, interval_s=wait_report_s):
        try:
            dist.init_process_group(
                backend=topology.backend,
                init_method="env://",
                rank=topology.rank,
                world_size=topology.world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
                **kwargs,
            )
        except (dist.DistStoreError, dist.DistNetworkError) as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RuntimeError(
                f"rank {topology.rank}: the process group did not form within {timeout_s:g} s "
                f"({detail[:160]}); a rank crashed or is stuck before it joined; "
                f"{_TIMEOUT_SETTINGS}"
            ) from exc
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
