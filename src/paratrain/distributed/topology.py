"""Who this process is in the job: ranks, sizes, device and backend.

The :class:`Topology` is discovered once from the launcher's environment
(torchrun / ``paratrain launch``, SLURM or Open MPI), validated once, and then
passed explicitly to everything that needs it. Nothing in paratrain reads the
rank from a global afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from paratrain.fault_tolerance.options import parse_replica_group
from paratrain.settings import Settings

ACCELERATORS = ("auto", "cpu", "cuda")
ACCELERATOR_ENV = "PARATRAIN_ACCELERATOR"
"""Replaces ``accelerator="auto"``: ``cpu`` pins every process to the CPU even with GPUs visible."""
SHARE_GPUS_ENV = "PARATRAIN_SHARE_GPUS"
"""``1`` lets more processes than GPUs run on one node (set by ``paratrain launch --share-gpus``)."""
SHARED_GPU_NOTICE = ("GPUs are shared: {processes} processes on {gpus} GPU(s) over gloo; "
                     "this is for testing multi-process code, not for speed")


def _int_env(environ: Mapping[str, str], name: str) -> int | None:
    value = environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


@dataclass(frozen=True)
class Topology:
    """The place of this process in a (possibly single-process) job.

    Attributes:
        rank: global rank, 0 .. world_size - 1.
        local_rank: rank among the processes on this node; selects ``cuda:<local_rank>``.
        world_size: number of processes in the job.
        local_world_size: number of processes on this node.
        node_rank: index of this node, 0 .. num_nodes - 1.
        num_nodes: number of nodes (hosts) in the job.
        device: the device this process computes on.
        backend: ``"gloo"`` on CPU, ``"nccl"`` on CUDA (``"gloo"`` when GPUs are shared).
        source: which environment the values came from (``torchrun``, ``slurm``,
            ``openmpi`` or ``none`` when unlaunched).
        shares_device: True when this node runs more processes than it has GPUs and they
            share them round-robin (``PARATRAIN_SHARE_GPUS=1``): useful for testing only.
        replica_groups: fault-tolerant replica groups (``paratrain launch --fault-tolerant``),
            each running this ``world_size``-process job, that replicate it through torchft;
            1 without fault tolerance.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str = "gloo"
    source: str = "none"
    shares_device: bool = False
    replica_groups: int = 1

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank}")
        if self.local_world_size < 1 or self.local_world_size > self.world_size:
            raise ValueError(
                f"local_world_size must be in [1, world_size={self.world_size}], "
                f"got {self.local_world_size}"
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank must be in [0, local_world_size={self.local_world_size}), "
                f"got {self.local_rank}"
            )
        if self.num_nodes < 1 or not 0 <= self.node_rank < self.num_nodes:
            raise ValueError(
                f"node_rank must be in [0, num_nodes={self.num_nodes}), got {self.node_rank}"
            )
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {self.backend!r}")
        if self.backend == "nccl" and self.device.type != "cuda":
            raise ValueError("backend 'nccl' needs a CUDA device; use 'gloo' on CPU")
        if self.shares_device and (self.device.type != "cuda" or self.backend != "gloo"):
            # NCCL refuses two ranks on one device; gloo handles CUDA tensors by staging them.
            raise ValueError("shares_device needs a CUDA device and backend 'gloo'")

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part (a process group is needed)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints and writes replicated checkpoints."""
        return self.rank == 0

    @property
    def notice(self) -> str | None:
        """A line for rank 0 to print about an unusual placement, or None."""
        if not self.shares_device:
            return None
        return SHARED_GPU_NOTICE.format(processes=self.local_world_size,
                                        gpus=torch.cuda.device_count())

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, accelerator: str = "auto",
        share_gpus: bool | None = None, settings: Settings | None = None,
    ) -> Topology:
        """Discover the topology from the launcher's environment variables.

        Reads torchrun's ``RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/GROUP_RANK/
        GROUP_WORLD_SIZE`` first, then SLURM's ``SLURM_PROCID/...`` and Open MPI's
        ``OMPI_COMM_WORLD_*``. Without any of them this is a single process.

        ``accelerator="auto"`` is replaced by ``settings.accelerator``
        (``PARATRAIN_ACCELERATOR``: ``cpu`` or ``cuda``), so a test suite or launcher can pin
        every process to the CPU without changing scripts. ``share_gpus=None`` takes
        ``settings.share_gpus`` (``PARATRAIN_SHARE_GPUS``):
        when set, a node with more local processes than GPUs maps local rank ``r`` to
        ``cuda:(r % device_count)`` and uses gloo; without it that is refused. ``settings``
        defaults to those parsed from ``environ``.

        Example:
            >>> Topology.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).rank
            1
        """
        environ = os.environ if environ is None else environ
        if accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
        if settings is None:
            settings = Settings.from_environ(environ)
        if accelerator == "auto":
            accelerator = settings.accelerator or "auto"
        if share_gpus is None:
            share_gpus = bool(settings.share_gpus)
        values = _discover(environ)
        device, backend, shared = _select_device(
            values["local_rank"], values["local_world_size"], accelerator, share_gpus)
        return cls(device=device, backend=backend, shares_device=shared,
                   replica_groups=_replica_groups(settings.replica_group), **values)


def _replica_groups(replica_group: str | None) -> int:
    """R of ``PARATRAIN_REPLICA_GROUP=G/R`` (one line naming it when malformed); 1 unset."""
    return 1 if replica_group is None else parse_replica_group(replica_group)[1]



def _discover(environ: Mapping[str, str]) -> dict:
    if _int_env(environ, "WORLD_SIZE") is not None and _int_env(environ, "RANK") is not None:
        world_size = _int_env(environ, "WORLD_SIZE")
        local_world_size = _int_env(environ, "LOCAL_WORLD_SIZE") or world_size
        num_nodes = _int_env(environ, "GROUP_WORLD_SIZE")
        if num_nodes is None:
            num_nodes = max(1, world_size // max(1, local_world_size))
        node_rank = _int_env(environ, "GROUP_RANK")
        if node_rank is None:
            node_rank = _int_env(environ, "NODE_RANK") or 0
        return dict(
            rank=_int_env(environ, "RANK"),
            local_rank=_int_env(environ, "LOCAL_RANK") or 0,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=node_rank,
            num_nodes=num_nodes,
            source="torchrun",
        )
    if _int_env(environ, "SLURM_PROCID") is not None and _int_env(environ, "SLURM_NTASKS"):
        world_size = _int_env(environ, "SLURM_NTASKS")
        num_nodes = _int_env(environ, "SLURM_NNODES") or 1
        per_node = environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
        local_world_size = int(per_node) if per_node.isdigit() else max(1, world_size // num_nodes)
        return dict(
            rank=_int_env(environ, "SLURM_PROCID"),
            local_rank=_int_env(environ, "SLURM_LOCALID") or 0,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=_int_env(environ, "SLURM_NODEID") or 0,
            num_nodes=num_nodes,
            source="slurm",
        )
    if _int_env(environ, "OMPI_COMM_WORLD_RANK") is not None:
        world_size = _int_env(environ, "OMPI_COMM_WORLD_SIZE") or 1
        local_world_size = _int_env(environ, "OMPI_COMM_WORLD_LOCAL_SIZE") or world_size
        num_nodes = max(1, world_size // local_world_size)
        rank = _int_env(environ, "OMPI_COMM_WORLD_RANK")
        return dict(
            rank=rank,
            local_rank=_int_env(environ, "OMPI_COMM_WORLD_LOCAL_RANK") or 0,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=_int_env(environ, "OMPI_COMM_WORLD_NODE_RANK") or rank // local_world_size,
            num_nodes=num_nodes,
            source="openmpi",
        )
    return dict(rank=0, local_rank=0, world_size=1, local_world_size=1, node_rank=0,
                num_nodes=1, source="none")


def _select_device(local_rank: int, local_world_size: int, accelerator: str,
                   share_gpus: bool) -> tuple[torch.device, str, bool]:
    use_cuda = accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu"), "gloo", False
    if not torch.cuda.is_available():
        raise ValueError("accelerator='cuda' but no CUDA device is visible; use accelerator='cpu'")
    num_gpus = torch.cuda.device_count()
    # Decided on the node's process count, not this rank's, so that every local
    # rank refuses (or picks gloo) alike instead of some waiting for the others.
    if local_world_size <= num_gpus:
        # One GPU per process: LOCAL_RANK selects the device, so processes never share one.
        return torch.device("cuda", local_rank), "nccl", False
    if not share_gpus:
        raise ValueError(
            f"LOCAL_RANK={local_rank} of {local_world_size} processes on this node but only "
            f"{num_gpus} CUDA device(s) are visible; launch at most {num_gpus} processes per "
            f"node (--nproc-per-node), or share GPUs for testing with --share-gpus "
            f"({SHARE_GPUS_ENV}=1)"
        )
    # NCCL refuses two ranks on one device; gloo moves CUDA tensors through host memory.
    return torch.device("cuda", local_rank % num_gpus), "gloo", True
