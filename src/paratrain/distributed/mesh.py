"""Parallel degrees and the device mesh they describe, validated once.

A job of ``world_size`` processes is laid out as a 5-D grid
``pipeline x replicate x shard x context x tensor`` (outermost first):

* ``pipeline_degree``: stages of a pipeline (each holds some layers);
* ``replicate_degree``: full replicas whose gradients are all-reduced (DDP-like);
* ``shard_degree``: ranks over which parameters, gradients and optimizer state
  are sharded (FSDP). With ``replicate_degree > 1`` too this is HSDP;
* ``context_degree``: ranks that split each sequence (context parallel); they read
  the same samples, each a slice of every sequence;
* ``tensor_degree``: ranks that split each layer's weights (tensor parallel);
  they read the same data.

``expert_degree`` is not an axis of its own: as in torchtitan, expert parallel borrows
ranks from ``shard x context`` (the experts of a MoE layer are split over ``expert_degree``
consecutive ranks of that block, and FSDP-sharded over the rest of it).

Groups by job (torchtitan's ``batch``/``loss``/``fsdp`` meshes): the *batch* ranks read
different data (``replicate x shard``); the *loss* ranks are what losses and metrics are
averaged over (``batch x context``); FSDP shards over ``shard x context`` (HSDP replicates
over ``replicate``).

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
    (1, 1, 2, 1, 2)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import torch.distributed as dist

from paratrain.distributed._compat import flattened_group
from paratrain.distributed.topology import Topology

AXES = ("pipeline", "replicate", "shard", "context", "tensor")
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

    context_degree: int = 1
    """Context-parallel ranks that split each sequence and read the same samples."""

    expert_degree: int = 1
    """Ranks over which each MoE layer's experts are split (borrowed from shard x context)."""

    def __post_init__(self) -> None:
        for axis in (*AXES, "expert"):
            value = getattr(self, f"{axis}_degree")
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{axis}_degree must be an integer >= 1, got {value!r}")
        borrowed = self.shard_degree * self.context_degree
        if borrowed % self.expert_degree:
            raise ValueError(f"expert_degree={self.expert_degree} must divide dp_shard x cp "
                             f"= {borrowed} (expert parallel borrows those ranks); choose "
                             f"an ep that divides {borrowed}, or raise dp_shard")

    @property
    def world_size(self) -> int:
        return math.prod(self.shape)

    @property
    def data_parallel_degree(self) -> int:
        """Ranks that read different data: replicas times shards."""
        return self.replicate_degree * self.shard_degree

    @property
    def loss_degree(self) -> int:
        """Ranks over which losses and metrics are averaged: data parallel x context."""
        return self.data_parallel_degree * self.context_degree

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """The mesh's shape, in :data:`AXES` order."""
        return (self.pipeline_degree, self.replicate_degree, self.shard_degree,
                self.context_degree, self.tensor_degree)

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
    """This rank's index along each axis (row-major, tensor innermost, then context)."""
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
    def context_rank(self) -> int:
        return self.coords["context"]

    @property
    def data_parallel_rank(self) -> int:
        """Index of this rank's data shard: replicas x shards, shard innermost."""
        return self.coords["replicate"] * self.degrees.shard_degree + self.coords["shard"]

    @cached_property
    def device_mesh(self):  # -> torch.distributed.device_mesh.DeviceMesh
        """The 5-D ``DeviceMesh`` (a collective call: every rank builds it at the same point)."""
        from torch.distributed.device_mesh import init_device_mesh

        if not dist.is_initialized():
            raise RuntimeError("a DeviceMesh needs a process group; launch with several processes")
        mesh = init_device_mesh(self.topology.device.type, self.degrees.shape,
                                mesh_dim_names=AXES)
        d = self.degrees
        if d.shard_degree > 1 and d.tensor_degree > 1:
            # FSDP over tensor-parallel pieces: whole() gathers such a parameter in one
            # all_gather over shard x tensor. Built here, where every rank is, because
            # the stages of a pipeline need not all hold such a parameter.
            flattened_group(mesh["shard", "tensor"])
        if d.context_degree > 1:
            # FSDP shards over shard x context (the cp ranks hold the same parameters).
            flattened_group(mesh["shard", "context"], name="fsdp")
        return mesh

    def fsdp_mesh(self, *, replicate: bool = True):
        """The mesh FSDP shards over: ``shard`` (``shard x context`` flattened with cp), with
        ``replicate`` as HSDP's outer axis when there are replicas (and ``replicate``: False
        keeps the replicas apart, as semi-synchronous training does)."""
        shard = "fsdp" if self.degrees.context_degree > 1 else "shard"
        self.device_mesh  # noqa: B018  (builds the flattened axis first)
        if self.degrees.replicate_degree > 1 and replicate:
            return self.device_mesh["replicate", shard]
        return self.device_mesh[shard]

    @cached_property
    def expert_mesh(self):  # -> DeviceMesh
        """``pipeline x replicate x expert_shard x expert x tensor``: ``shard x context``
        flattened and cut into groups of ``expert_degree`` consecutive ranks (a collective
        call). Experts are split over ``expert`` and FSDP-sharded over ``expert_shard``."""
        from torch.distributed.device_mesh import init_device_mesh

        d = self.degrees
        borrowed = d.shard_degree * d.context_degree
        return init_device_mesh(
            self.topology.device.type,
            (d.pipeline_degree, d.replicate_degree, borrowed // d.expert_degree,
             d.expert_degree, d.tensor_degree),
            mesh_dim_names=("pipeline", "replicate", "expert_shard", "expert", "tensor"))

    @cached_property
    def data_parallel_group(self) -> dist.ProcessGroup:
        """The *batch* ranks: those that read different data (``replicate x shard``) and
        share this rank's pipeline, context and tensor coordinates. A collective call the
        first time: every rank asks at the same point."""
        d = self.degrees
        if d.replicate_degree == 1 or d.shard_degree == 1:
            return self.group("replicate" if d.shard_degree == 1 else "shard")
        return self._group_over("replicate", "shard")

    @cached_property
    def loss_group(self) -> dist.ProcessGroup:
        """The *loss* ranks: batch x context, over which losses and metrics are averaged
        (each cp rank holds a slice of the same samples). A collective the first time."""
        if self.degrees.context_degree == 1:
            return self.data_parallel_group
        return self._group_over("replicate", "shard", "context")

    @cached_property
    def replica_peers_group(self) -> dist.ProcessGroup:
        """The ranks of this rank's replica group: every axis but ``replicate`` (those that
        step together under semi-synchronous training). A collective the first time."""
        return self._group_over(*(axis for axis in AXES if axis != "replicate"))

    def _group_over(self, *axes: str) -> dist.ProcessGroup:
        # One group per combination of the other axes' coordinates, over ``axes``.
        d = dict(zip(AXES, self.degrees.shape))
        others = [a for a in AXES if a not in axes]
        groups = []
        for fixed in _grid(others, d):
            groups.append([self.global_rank(**fixed, **free) for free in _grid(list(axes), d)])
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


def _grid(axes: list[str], sizes: dict[str, int]) -> list[dict[str, int]]:
    """Every combination of coordinates along ``axes``, the last one fastest."""
    combos: list[dict[str, int]] = [{}]
    for axis in axes:
        combos = [{**c, axis: i} for c in combos for i in range(sizes[axis])]
    return combos
