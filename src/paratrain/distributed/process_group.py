"""Process-group lifetime: initialise once with a timeout, tear down in the right order.

While the ranks gather in :func:`init_process_group` a rank that waits longer
than a few seconds says so every ``PARATRAIN_WAIT_REPORT_S`` (30 s), and a
rank that never comes ends the wait with one line instead of torch's
``DistStoreError`` traceback.

A second group in the same process (``Run(...)`` ... ``run.close()``, then another
``Run``) meets in the store of the first, under keys of its own generation: a fresh
``env://`` rendezvous would reuse the first group's keys, which the store still holds
(under ``paratrain launch`` it is the agent's and outlives every group), so a rank read
the closed group's addresses and waited for them past its timeout.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

from paratrain.distributed import _compat
from paratrain.distributed.topology import Topology
from paratrain.reliability import waits

_TIMEOUT_SETTINGS = "Run(timeout_s=...) or PARATRAIN_TIMEOUT_S sets the wait"
# The rendezvous of this process's first group, kept for the ones after it (see the
# module docstring): its store, where it is (MASTER_ADDR, MASTER_PORT, world size) and
# how many groups formed in it. Per process, like the default group itself.
_rendezvous: dict[str, Any] = {}


def init_process_group(topology: Topology, *, timeout_s: float,
                       wait_report_s: float = 30.0) -> bool:
    """Create the default process group for ``topology``; return True if this call created it.

    A single process needs no group. When one is already initialised (a user script
    that called ``init_process_group`` itself, Ray Train's workers) it is reused if it
    agrees with ``topology`` (:func:`check_existing_group`). When
    processes share GPUs (``topology.shares_device``), rank 0 prints one notice. While
    ranks are missing a notice comes every ``wait_report_s`` (``PARATRAIN_WAIT_REPORT_S``).
    """
    if dist.is_initialized():
        check_existing_group(topology)
        return False
    if not topology.is_distributed:
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
    timeout = datetime.timedelta(seconds=timeout_s)
    where = (os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"], topology.world_size)
    if _rendezvous.get("where") == where and _rendezvous.get("store") is not None:
        # A later group: the same store, this generation's keys (the first group's are
        # torch's env:// ones, unchanged, so restarted jobs meet as before).
        store = _rendezvous["store"]
        store.set_timeout(timeout)
        kwargs["store"] = dist.PrefixStore(f"paratrain/group{_rendezvous['groups']}", store)
    else:
        kwargs["init_method"] = "env://"
    with waits.reporting(waiting, interval_s=wait_report_s):
        try:
            dist.init_process_group(
                backend=topology.backend,
                rank=topology.rank,
                world_size=topology.world_size,
                timeout=timeout,
                **kwargs,
            )
        except (dist.DistStoreError, dist.DistNetworkError) as exc:
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise RuntimeError(
                f"rank {topology.rank}: the process group did not form within {timeout_s:g} s "
                f"({detail[:160]}); a rank crashed or is stuck before it joined; "
                f"{_TIMEOUT_SETTINGS}"
            ) from exc
    if "store" not in kwargs:
        _rendezvous.update(where=where, store=_rendezvous_store(), groups=0)
    _rendezvous["groups"] += 1
    return True


def check_existing_group(topology: Topology) -> None:
    """Refuse a default group made by someone else (the script, Ray Train) that disagrees
    with the environment: training would otherwise run unsynchronised or on the wrong device.

    Ray Train and torchrun set ``RANK``/``WORLD_SIZE`` beside the group they make, so a
    mismatch means a script that formed its group by hand without them.
    """
    rank, size = dist.get_rank(), dist.get_world_size()
    if (rank, size) != (topology.rank, topology.world_size):
        raise RuntimeError(
            f"a process group already exists with this process as rank {rank} of {size}, but "
            f"the environment says rank {topology.rank} of {topology.world_size}; set RANK, "
            "WORLD_SIZE and LOCAL_RANK to match it (torchrun, paratrain launch and Ray Train do)")
    backend = str(dist.get_backend()).lower()
    # "cpu:gloo,cuda:nccl" (a group made with several backends) names one per device type.
    per_device = dict(item.split(":", 1) for item in backend.split(",") if ":" in item)
    serving = per_device.get(topology.device.type, backend)
    # Other backends (mpi, ucc, a vendor's) are the script's choice: not judged here.
    if serving in ("gloo", "nccl") and serving != topology.backend:
        raise RuntimeError(
            f"the process group that already exists uses {backend} but this run computes on "
            f"{topology.device.type} with {topology.backend}; make them agree (Ray Train: "
            "ScalingConfig(use_gpu=...) and Run(accelerator=...))")


def _rendezvous_store() -> Any:
    """The store the default group's prefixes wrap (the TCP store of the rendezvous)."""
    store = _compat.default_store()
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store


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
