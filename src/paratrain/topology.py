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

ACCELERATORS = ("auto", "cpu", "cuda")


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
        backend: ``"gloo"`` on CPU, ``"nccl"`` on CUDA.
        source: which environment the values came from (``torchrun``, ``slurm``,
            ``openmpi`` or ``none`` when unlaunched).
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

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part (a process group is needed)."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints and writes replicated checkpoints."""
        return self.rank == 0

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, accelerator: str = "auto"
    ) -> Topology:
        """Discover the topology from the launcher's environment variables.

        Reads torchrun's ``RANK/LOCAL_RANK/WORLD_SIZE/LOCAL_WORLD_SIZE/GROUP_RANK/
        GROUP_WORLD_SIZE`` first, then SLURM's ``SLURM_PROCID/...`` and Open MPI's
        ``OMPI_COMM_WORLD_*``. Without any of them this is a single process.

        Example:
            >>> Topology.from_env({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}).rank
            1
        """
        environ = os.environ if environ is None else environ
        if accelerator not in ACCELERATORS:
            raise ValueError(f"accelerator must be one of {ACCELERATORS}, got {accelerator!r}")
        values = _discover(environ)
        device, backend = _select_device(values["local_rank"], accelerator)
        return cls(device=device, backend=backend, **values)


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


def _select_device(local_rank: int, accelerator: str) -> tuple[torch.device, str]:
    use_cuda = accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())
    if not use_cuda:
        return torch.device("cpu"), "gloo"
    if not torch.cuda.is_available():
        raise ValueError("accelerator='cuda' but no CUDA device is visible; use accelerator='cpu'")
    num_gpus = torch.cuda.device_count()
    if local_rank >= num_gpus:
        raise ValueError(
            f"LOCAL_RANK={local_rank} but only {num_gpus} CUDA device(s) are visible; "
            f"launch at most {num_gpus} processes per node (--nproc-per-node)"
        )
    # One GPU per process: LOCAL_RANK selects the device, so processes never share one.
    return torch.device("cuda", local_rank), "nccl"
