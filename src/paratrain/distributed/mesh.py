"""Parallel degrees and the device mesh they describe, validated once.

A job of ``world_size`` processes is laid out as a 4-D grid
``pipeline x replicate x shard x tensor`` (outermost first):

* ``pipeline_degree``: stages of a pipeline (each holds some layers);
* ``replicate_degree``: full replicas whose gradients are all-reduced (DDP-like);
* ``shard_degree``: ranks over which parameters, gradients and optimizer state
  are sharded (FSDP). With ``replicate_degree > 1`` too this is HSDP;
* ``tensor_degree``: ranks that split each layer's weights (tensor parallel);
  they read the same data.

The tensor axis is innermost, then shard, so that consecutive ranks (the
processes of one node) carry the chattiest traffic (a tensor-parallel
all-reduce per layer, then the FSDP all-gathers) and only the replicate /
pipeline axes cross nodes.
:class:`ParallelDegrees` is pure logic (testable without processes);
:class:`ParallelMesh` adds this rank's coordinates and the ``DeviceMesh``.

Example:
    >>> degrees = ParallelDegrees.infer(world_size=4, pipeline_degree=2)
    >>> (degrees.pipeline_degree, degrees.replicate_degree, degrees.shard_degree)
    (2, 2, 1)
    >>> ParallelDegrees.infer(world_size=4, shard_degree=2, tensor_degree=2).shape
    (1, 1, 2, 2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist

from paratrain.distributed._compat import flattened_group
from paratrain.distributed.topology import Topology

AXES = ("pipeline", "replicate", "shard", "tensor")
"""Mesh dimension names, outermost first."""


@dataclass(frozen=True, kw_only=True)
class ParallelDegrees:
    """How many ways the job is split along each axis; their product is the world size."""

    pipeline_degree: int = 1
    """Pipeline stages."""

    replicate_degree: int = 1
    """Data-parallel replicas that all-reduce gradients."""

    shard_degree: int = 1
    """Data-parallel ranks that shard parameters, gradients and optimizer state."""

    tensor_degree: int = 1
    """Tensor-parallel ranks that split each layer's weights and read the same data."""

    def __post_init__(self) -> None:
        for axis in AXES:
            value = getattr(self, f"{axis}_degree")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{axis}_degree must be an integer >= 1, got {value!r}")

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def data_parallel_degree(self) -> int:
        """Ranks that read different data: replicas times shards."""
        return self.replicate_degree * self.shard_degree

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.pipeline_degree, self.replicate_degree, self.shard_degree,
                self.tensor_degree)

    def validate(self, world_size: int) -> None:
        """ValueError naming the bad degree unless the product equals ``world_size``."""
        for axis in AXES:
            _check_divides(axis, getattr(self, f"{axis}_degree"), world_size)
        if self.world_size != world_size:
            # Each degree divides the world size but together they do not cover it:
            # no single degree is wrong, so the message names them all.
            product = " x ".join(f"{a}_degree={getattr(self, f'{a}_degree')}" for a in AXES)
            raise ValueError(
                f"{product} = {self.world_size} but the world size is {world_size}; "
                "the product of the degrees must equal the number of processes"
            )

    @classmethod
    def infer(cls, *, world_size: int, pipeline_degree: int | None = None,
              replicate_degree: int | None = None,
              shard_degree: int | None = None, tensor_degree: int = 1) -> ParallelDegrees:
        """Infer one degree left as None (replicate first, then shard, then pipeline)
        as world size / the others, and validate. Other degrees left as None are 1;
        ``tensor_degree`` is never inferred.
        """
        given = {"pipeline": pipeline_degree, "replicate": replicate_degree,
                 "shard": shard_degree, "tensor": tensor_degree}
        missing = [axis for axis, value in given.items() if value is None]
        for axis, value in given.items():
            if value is not None:
                cls(**{f"{axis}_degree": value})  # type check with the field's message
                _check_divides(axis, value, world_size)
        known = math.prod(v for v in given.values() if v is not None)
        fill = next((a for a in ("replicate", "shard", "pipeline") if a in missing), None)
        for axis in missing:
            given[axis] = 1
        if fill is not None:
            if world_size % known:
                raise ValueError(
                    f"{fill}_degree cannot be inferred: the other degrees multiply to {known}, "
                    f"which does not divide the world size {world_size}"
                )
            given[fill] = world_size // known
        degrees = cls(**{f"{axis}_degree": value for axis, value in given.items()})
        degrees.validate(world_size)
        return degrees


def _check_divides(axis: str, value: int, world_size: int) -> None:
    if world_size % value:
        raise ValueError(f"{axis}_degree={value} does not divide the world size {world_size}; "
                         f"choose a divisor of {world_size}")


def coordinates(rank: int, degrees: ParallelDegrees) -> dict[str, int]:
    """This rank's index along each axis (row-major, tensor innermost)."""
    if not 0 <= rank < degrees.world_size:
        raise ValueError(f"rank must be in [0, {degrees.world_size}), got {rank}")
    coords = {}
    for axis, size in reversed(list(zip(AXES, degrees.shape))):
        rank, coords[axis] = divmod(rank, size)
    return {axis: coords[axis] for axis in AXES}


class ParallelMesh:
    """The validated degrees, this rank's coordinates and (lazily) the ``DeviceMesh``.

    Args:
        degrees: the parallel degrees; validated against ``topology.world_size`` here.
        topology: this process's place in the job.
    """

    def __init__(self, degrees: ParallelDegrees, topology: Topology) -> None:
        degrees.validate(topology.world_size)
        self.degrees = degrees
        self.topology = topology
        self.coords = coordinates(topology.rank, degrees)

    @property
    def pipeline_rank(self) -> int:
        return self.coords["pipeline"]

    @property
    def data_parallel_rank(self) -> int:
        """Index of this rank's data shard: replicas x shards, shard innermost."""
        return self.coords["replicate"] * self.degrees.shard_degree + self.coords["shard"]

    @cached_property
    def device_mesh(self):  # -> torch.distributed.device_mesh.DeviceMesh
        """The 4-D ``DeviceMesh`` (a collective call: every rank builds it at the same point)."""
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("a DeviceMesh needs a process group; launch with several processes")
        mesh = init_device_mesh(self.topology.device.type, self.degrees.shape,
                                mesh_dim_names=AXES)
        if self.degrees.shard_degree > 1 and self.degrees.tensor_degree > 1:
            # FSDP over tensor-parallel pieces: whole() gathers such a parameter in one
            # all_gather over shard x tensor. Built here, where every rank is, because
            # the stages of a pipeline need not all hold such a parameter.
            flattened_group(mesh["shard", "tensor"])
        return mesh

    @cached_property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """The ranks that read different data (``replicate x shard``) and share this rank's
        pipeline and tensor coordinates. A collective call the first time: every rank
        asks at the same point."""
        d = self.degrees
        if d.replicate_degree == 1 or d.shard_degree == 1:
            return self.group("replicate" if d.shard_degree == 1 else "shard")
        # Two data axes: one group per (pipeline, tensor) pair over both of them.
        groups = [[self.global_rank(pipeline=p, tensor=t, replicate=r, shard=s)
                   for r in range(d.replicate_degree) for s in range(d.shard_degree)]
                  for p in range(d.pipeline_degree) for t in range(d.tensor_degree)]
        mine, _ = dist.new_subgroups_by_enumeration(groups)
        return mine

    def submesh(self, *axes: str):
        """The mesh restricted to ``axes`` (e.g. ``("replicate", "shard")`` for HSDP)."""
        return self.device_mesh[axes if len(axes) > 1 else axes[0]]

    def group(self, axis: str) -> dist.ProcessGroup:
        """The process group along one axis (the ranks that differ only in ``axis``)."""
        return self.device_mesh.get_group(axis)

    def global_rank(self, **coords: int) -> int:
        """Global rank at this rank's coordinates with ``coords`` replaced."""
        merged = {**self.coords, **coords}
        rank = 0
        for axis, size in zip(AXES, self.degrees.shape):
            rank = rank * size + merged[axis]
        return rank
