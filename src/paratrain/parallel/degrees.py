"""The user's description of a layout: how many ways each axis splits the job.

``Parallel`` is what ``Run(parallel=...)`` and ``paratrain launch --parallel`` take; it
may leave one degree as ``-1`` (fill the world). :meth:`Parallel.resolve` checks it once
against the job (product = world size, tensor inside a node) and gives the
:class:`~paratrain.distributed.mesh.ParallelDegrees` every apply function receives.

Example:
    >>> Parallel.parse("dp_shard=-1,tp=2").resolve(world_size=8).shape
    (1, 1, 4, 1, 2)
    >>> Parallel.parse({"dp_replicate": 2, "dp_shard": 2}).resolve(world_size=4).shape
    (1, 2, 2, 1, 1)
    >>> Parallel.parse("ep=2").resolve(world_size=2).shape     # dp_shard fills the world
    (1, 1, 2, 1, 1)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from paratrain.distributed.mesh import ParallelDegrees
from paratrain.parallel.options import (
    SEMI_SYNC,
    ContextParallel,
    Pipeline,
    Sharding,
    TensorParallel,
)

DEGREES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Degree fields, outermost mesh axis first (the order of ``ParallelDegrees.shape``)."""

NAMES = (*DEGREES, "ep")
"""Every degree a layout names: the mesh's axes and ``ep``, which borrows ranks."""

_OPTIONS = {"tensor": TensorParallel, "sharding": Sharding, "pipeline": Pipeline,
            "context": ContextParallel}
_OPTION_DEGREE = {"tensor": "tp", "sharding": "dp_shard", "pipeline": "pp", "context": "cp"}


@dataclass(frozen=True, kw_only=True)
class Parallel:
    """A layout: degrees whose product is the world size, and each parallelism's options.

    ``ep`` is not part of the product: expert parallel borrows ranks from
    ``dp_shard x cp`` (it must divide it). With ``ep`` and no data degree given,
    ``dp_shard`` fills the world (``"ep=2"`` on 2 ranks: data parallel 2, experts split
    over the same 2 ranks).
    """

    dp_replicate: int = 1
    """Replicas that all-reduce gradients (DDP; with ``dp_shard`` > 1, HSDP's replicas)."""

    dp_shard: int = 1
    """Ranks that shard parameters, gradients and optimizer state (FSDP)."""

    tp: int = 1
    """Ranks that split each layer's weights (tensor parallel); they must share a node."""

    pp: int = 1
    """Pipeline stages."""

    cp: int = 1
    """Ranks that split each sequence (context parallel): attention runs over the whole
    sequence by ring (or all-to-all) exchanges; losses average over data x cp."""

    ep: int = 1
    """Ranks over which each mixture-of-experts layer's experts are split (expert
    parallel, tokens dispatched by all-to-all); borrowed from ``dp_shard x cp``."""

    tensor: TensorParallel | None = None
    """Options of tensor parallelism (needs ``tp`` > 1)."""

    sharding: Sharding | None = None
    """Options of sharding (needs ``dp_shard`` > 1)."""

    pipeline: Pipeline | None = None
    """Options of the pipeline (needs ``pp`` > 1)."""

    context: ContextParallel | None = None
    """Options of context parallelism (needs ``cp`` > 1)."""

    semi_sync: Any = None
    """``LocalSGD(every=H)`` or ``DiLoCo(every=H, ...)``: replica groups (``dp_replicate``)
    step alone and synchronise every H optimizer steps instead of averaging gradients
    at every step; FSDP then shards within a group only. None: every step."""

    def __post_init__(self) -> None:
        if isinstance(self.ep, bool) or not isinstance(self.ep, int) or self.ep < 1:
            raise ValueError(f"Parallel.ep must be an integer >= 1, got {self.ep!r}")
        for name in DEGREES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or (value < 1
                                                                         and value != -1):
                raise ValueError(f"Parallel.{name} must be an integer >= 1, or -1 to fill "
                                 f"the world, got {value!r}")
        filled = [name for name in DEGREES if getattr(self, name) == -1]
        if len(filled) > 1:
            raise ValueError(f"Parallel: only one degree may be -1, got {filled}; give the "
                             "others as numbers")
        for name, cls in _OPTIONS.items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, cls):
                raise ValueError(f"Parallel.{name} must be a paratrain.{cls.__name__} or None, "
                                 f"got {type(value).__name__}")
        for name, degree in _OPTION_DEGREE.items():
            if getattr(self, name) is not None and getattr(self, degree) == 1:
                raise ValueError(f"Parallel.{name} options need {degree} > 1 (or -1); "
                                 f"set {degree} or drop {name}")
        self._check_semi_sync()

    def _check_semi_sync(self, replicas: int | None = None, replica_groups: int = 1) -> None:
        mode = self.semi_sync
        if mode is None:
            return
        if not isinstance(mode, SEMI_SYNC):
            raise ValueError("Parallel.semi_sync must be a paratrain.LocalSGD, a "
                             f"paratrain.DiLoCo or None, got {type(mode).__name__}")
        name = type(mode).__name__
        # The replicas are counted once the world is known (resolve): under fault
        # tolerance they are the replica groups, each of dp_replicate=1.
        if replicas is not None and replica_groups > 1 and replicas > 1:
            raise ValueError(f"Parallel.semi_sync={name} under --fault-tolerant syncs the "
                             f"{replica_groups} replica groups, so dp_replicate={replicas} "
                             "inside a group has no place; set dp_replicate=1 (each group "
                             "is one replica)")
        if replicas == 1 and replica_groups == 1:
            raise ValueError(f"Parallel.semi_sync={name} needs dp_replicate > 1 (the replica "
                             "groups that sync every H steps); set dp_replicate or drop "
                             "semi_sync")
        for degree, what in (("pp", "a pipeline"), ("ep", "expert parallel")):
            if getattr(self, degree) not in (1,):
                raise ValueError(f"Parallel.semi_sync={name} with {what} ({degree}="
                                 f"{getattr(self, degree)}) is not supported; drop {degree} "
                                 "or semi_sync")

    @classmethod
    def parse(cls, spec: Any) -> Parallel:
        """A ``Parallel``, a dict of its fields, or ``"dp_shard=4,tp=2"``; one-line errors."""
        if isinstance(spec, Parallel):
            return spec
        if isinstance(spec, str):
            return cls(**_parse_string(spec))
        if isinstance(spec, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(spec) - known)
            if unknown:
                raise ValueError(f"parallel has unknown field(s) {unknown}; known: "
                                 f"{sorted(known)}")
            return cls(**spec)
        raise ValueError("parallel must be a paratrain.Parallel, a dict or a string such as "
                         f"'dp_shard=4,tp=2', got {type(spec).__name__}")

    @classmethod
    def from_environment(cls, value: str) -> Parallel:
        """``PARATRAIN_PARALLEL``'s value parsed; its errors name the variable."""
        try:
            return cls.parse(value)
        except ValueError as exc:
            raise ValueError(f"PARATRAIN_PARALLEL={value!r}: {exc}") from None

    def resolve(self, *, world_size: int, local_world_size: int | None = None,
                replica_groups: int = 1) -> ParallelDegrees:
        """The validated degrees for a job; ValueError naming the bad degree.

        ``local_world_size`` (processes per node) bounds ``tp``: tensor-parallel ranks
        exchange activations at every layer and must share a node. ``replica_groups``:
        the fault-tolerant groups replicating the job, which are ``semi_sync``'s
        replicas when there are several.
        """
        given = {name: getattr(self, name) for name in DEGREES}
        if (self.ep > 1 and given["dp_shard"] == 1 and given["dp_replicate"] == 1
                and -1 not in given.values()):
            given["dp_shard"] = -1  # experts borrow the data ranks: they fill the world
        known = math.prod(v for v in given.values() if v != -1)
        for name, value in given.items():
            if value != -1 and world_size % value:
                raise ValueError(f"Parallel.{name}={value} does not divide the world size "
                                 f"{world_size}; choose a divisor of {world_size}")
        fill = next((name for name, value in given.items() if value == -1), None)
        if fill is not None:
            if world_size % known:
                raise ValueError(f"Parallel.{fill}=-1 cannot fill the world: the other "
                                 f"degrees multiply to {known}, which does not divide the "
                                 f"world size {world_size}")
            given[fill] = world_size // known
        if math.prod(given.values()) != world_size:
            product = " x ".join(f"{name}={value}" for name, value in given.items())
            raise ValueError(f"Parallel: {product} = {math.prod(given.values())} but the "
                             f"world size is {world_size}; make the product equal the number "
                             "of processes (or set one degree to -1)")
        node = local_world_size or world_size
        if given["tp"] > 1 and node % given["tp"]:
            raise ValueError(f"Parallel.tp={given['tp']} does not fit in a node of {node} "
                             "processes; tensor-parallel ranks must share a node: choose a "
                             f"tp that divides {node}")
        self._check_semi_sync(given["dp_replicate"], replica_groups)
        borrowed = given["dp_shard"] * given["cp"]
        if borrowed % self.ep:
            raise ValueError(f"Parallel.ep={self.ep} must divide dp_shard x cp = {borrowed} "
                             "(expert parallel borrows those ranks; tensor-parallel ranks are "
                             f"not borrowed yet): raise dp_shard or choose an ep dividing {borrowed}")
        return ParallelDegrees(pipeline_degree=given["pp"], replicate_degree=given["dp_replicate"],
                               shard_degree=given["dp_shard"], context_degree=given["cp"],
                               tensor_degree=given["tp"], expert_degree=self.ep)

    def __str__(self) -> str:
        parts = [f"{name}={getattr(self, name)}" for name in NAMES
                 if getattr(self, name) != 1]
        return ",".join(parts) or "dp_replicate=1"


def describe(degrees: ParallelDegrees) -> str:
    """``dp_replicate=2,dp_shard=2`` for resolved degrees (axes of size 1 left out)."""
    values = {**dict(zip(DEGREES, degrees.shape)), "ep": degrees.expert_degree}
    parts = [f"{name}={values[name]}" for name in NAMES if values[name] != 1]
    return ",".join(parts) or "one process"


def _parse_string(text: str) -> dict[str, int]:
    values: dict[str, int] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name = name.strip()
        if not sep or name not in NAMES:
            raise ValueError(f"parallel {text!r}: expected comma-separated degrees such as "
                             f"'dp_shard=4,tp=2' (names: {', '.join(NAMES)}), got {item!r}")
        if name in values:
            raise ValueError(f"parallel {text!r}: {name} is given twice")
        try:
            values[name] = int(value)
        except ValueError:
            raise ValueError(f"parallel {text!r}: {name} must be an integer, got "
                             f"{value.strip()!r}") from None
    if not values:
        raise ValueError("parallel is empty; give degrees such as 'dp_shard=4,tp=2'")
    return values
