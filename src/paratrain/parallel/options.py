"""Typed options of each parallelism, one small dataclass each, defined once.

They travel inside :class:`~paratrain.parallel.Parallel` (``tensor=``, ``sharding=``,
``pipeline=``, ``context=``, ``semi_sync=``) and are the options the runtime reads: the
layout strategy takes them as they are, and the named presets (``fsdp``, ``tp``,
``pipeline``, ...) turn their ``strategy_options`` into them. Each validates itself with
a one-line ``ValueError`` naming the field; this module imports nothing of the runtime,
so ``parallel/`` sits below ``strategies/``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from torch import nn

STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
          "embedding_rowwise")
"""Styles a tensor-parallel plan may name (see :mod:`paratrain.strategies.tensor.plan`)."""

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zero_bubble", "zbv", "dualpipev")
"""Pipeline schedules (see :mod:`paratrain.strategies.pipeline.schedules`)."""

MULTI_STAGE_SCHEDULES = {"interleaved_1f1b": "looped", "interleaved_zero_bubble": "looped",
                         "zbv": "v", "dualpipev": "v"}
"""Schedules with several stages per rank: looped (rank ``r`` of ``p`` runs ``r, r + p,
...``) or in a V (two stages: ``r`` and ``2p - 1 - r``)."""

CONTEXT_METHODS = ("ring", "all_to_all")
"""How attention is computed over a sequence split across the cp ranks."""


def _check_bool(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be True or False, got {value!r}")


def validate_plan(plan: Any) -> None:
    """ValueError naming the bad entry unless ``plan`` maps pattern strings to styles."""
    if plan is None:
        return
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"plan must be a non-empty dict {{pattern: style}} or None, got {plan!r}")
    for pattern, style in plan.items():
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"plan pattern must be a non-empty string, got {pattern!r}")
        if style not in STYLES:
            hint = ("; norms are sharded by strategy_options={'sequence_parallel': True}, "
                    "leave them out of the plan" if style == "sequence" else "")
            raise ValueError(f"plan[{pattern!r}] has style {style!r}; choose one of "
                             f"{', '.join(STYLES)}{hint}")


@dataclass(frozen=True, kw_only=True)
class TensorParallel:
    """Options of tensor parallelism (the ``tp`` degree).

    Example:
        >>> TensorParallel(sequence_parallel=True).sequence_parallel
        True
    """

    plan: dict[str, str] | None = None
    """``{glob over module names: style}`` (``"colwise"``, ``"rowwise"``, ...); None: the
    plan transformers ships with the model, else a registered adapter's, else the
    automatic plan for standard blocks."""

    sequence_parallel: bool = False
    """Shard the residual stream and the norms over the sequence between split layers."""

    loss_parallel: bool = False
    """Split the output layer over the vocabulary; its logits stay sharded (a DTensor) and
    ``F.cross_entropy`` on them works as written."""

    output_layer: str | None = None
    """The output linear loss parallel splits; None: ``head``, ``lm_head`` or ``output``."""

    def __post_init__(self) -> None:
        validate_plan(self.plan)
        _check_bool("TensorParallel", "sequence_parallel", self.sequence_parallel)
        _check_bool("TensorParallel", "loss_parallel", self.loss_parallel)
        if self.output_layer is not None and (not isinstance(self.output_layer, str)
                                              or not self.output_layer):
            raise ValueError(f"output_layer must be a module name, got {self.output_layer!r}")
        if self.output_layer is not None and not self.loss_parallel:
            raise ValueError("output_layer is only used with loss_parallel=True; set both")


def _is_class_spec(value: Any) -> bool:
    return isinstance(value, str) or (isinstance(value, type) and issubclass(value, nn.Module))


@dataclass(frozen=True, kw_only=True)
class Sharding:
    """Options of sharded data parallelism (the ``dp_shard`` degree, FSDP2).

    Example:
        >>> Sharding(reshard_after_forward=False).reshard_after_forward
        False
    """

    wrap_policy: Any = None
    """Which submodules become their own FSDP unit (all-gathered separately): None = for
    a Hugging Face model, each block named by its ``_no_split_modules`` and the input
    embedding and output layer; for other models every direct child that has parameters
    (a ``ModuleList``/``ModuleDict`` child's members individually); a module class, a class
    name or a tuple of them; or a predicate ``fn(module) -> bool``. The root is always
    wrapped last."""

    reshard_after_forward: bool = True
    """Free the gathered parameters after each unit's forward (ZeRO-3); False keeps them
    for backward (ZeRO-2: more memory, one all-gather fewer per step)."""

    offload: bool = False
    """Keep sharded parameters, gradients and optimizer state in CPU memory (FSDP2's
    ``CPUOffloadPolicy``); the optimizer steps on the CPU."""

    def __post_init__(self) -> None:
        policy = self.wrap_policy
        many = isinstance(policy, (tuple, list))
        if not (policy is None or _is_class_spec(policy) or (callable(policy) and not many)
                or (many and policy and all(_is_class_spec(p) for p in policy))):
            raise ValueError("wrap_policy must be None, a module class, a class name, a tuple "
                             f"of them or a predicate fn(module) -> bool, got {policy!r}")
        _check_bool("Sharding", "reshard_after_forward", self.reshard_after_forward)
        _check_bool("Sharding", "offload", self.offload)


@dataclass(frozen=True, kw_only=True)
class Pipeline:
    """Options of pipeline parallelism (the ``pp`` degree).

    Example:
        >>> Pipeline(schedule="interleaved_1f1b").num_local_stages
        2
    """

    schedule: str = "1f1b"
    """``gpipe``, ``1f1b`` (the default), ``interleaved_1f1b``, ``interleaved_zero_bubble``,
    ``zbv`` or ``dualpipev`` (``-`` may stand for ``_``). Same gradients; 1F1B keeps fewer
    activations alive than GPipe; the interleaved schedules run several smaller stages
    per rank in a loop, so the pipeline fills and drains faster; the zero-bubble ones
    (``interleaved_zero_bubble``, ``zbv``, ``dualpipev``) also split each backward into the
    input's and the weights' part and fill the bubble with the latter; ``zbv`` and
    ``dualpipev`` place two stages per rank in a V."""

    microbatches: int = 4
    """Micro-batches per step. More shrinks the bubble but makes each one smaller; a batch
    that does not divide uses the largest divisor below this number (that the schedule
    can run: ``dualpipev`` needs at least ``2 pp``)."""

    stages_per_rank: int | None = None
    """Stages each rank runs: with ``interleaved_1f1b`` or ``interleaved_zero_bubble`` 2 or
    more (default 2), rank ``r`` of ``p`` running ``r, r + p, r + 2p, ...``; with ``zbv``
    and ``dualpipev`` 2 (rank ``r`` runs ``r`` and ``2p - 1 - r``); else 1."""

    split_points: tuple[int, ...] | None = None
    """Where stages 1.. begin (``nn.Sequential`` children, or blocks of a model with a
    ``pipeline_layout()``); None balances the stages."""

    def __post_init__(self) -> None:
        if isinstance(self.schedule, str) and "-" in self.schedule:
            object.__setattr__(self, "schedule", self.schedule.replace("-", "_"))
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, "
                             f"got {self.schedule!r}")
        if (not isinstance(self.microbatches, int) or isinstance(self.microbatches, bool)
                or self.microbatches < 1):
            raise ValueError(f"microbatches must be an integer >= 1, got {self.microbatches!r}")
        per_rank, placement = self.stages_per_rank, MULTI_STAGE_SCHEDULES.get(self.schedule)
        if per_rank is not None and (not isinstance(per_rank, int) or per_rank < 1):
            raise ValueError(f"stages_per_rank must be an integer >= 1, got {per_rank!r}")
        if placement == "looped" and per_rank == 1:
            raise ValueError(f"schedule '{self.schedule}' needs stages_per_rank >= 2; "
                             "use schedule '1f1b' for one stage per rank")
        if placement == "v" and per_rank not in (None, 2):
            raise ValueError(f"schedule '{self.schedule}' runs exactly 2 stages per rank "
                             f"(a V), got stages_per_rank={per_rank}")
        if placement is None and per_rank not in (None, 1):
            raise ValueError(f"stages_per_rank={per_rank} needs schedule 'interleaved_1f1b' "
                             "or 'interleaved_zero_bubble'")
        points = self.split_points
        if points is not None and (not all(isinstance(p, int) and p > 0 for p in points)
                                   or list(points) != sorted(set(points))):
            raise ValueError(
                f"split_points must be increasing positive child indices, got {points!r}")

    @property
    def num_local_stages(self) -> int:
        """Stages each rank runs."""
        return self.stages_per_rank or (2 if self.schedule in MULTI_STAGE_SCHEDULES else 1)


@dataclass(frozen=True, kw_only=True)
class ContextParallel:
    """Options of context parallelism (the ``cp`` degree): a sequence split over ranks.

    Example:
        >>> ContextParallel(method="all_to_all").method
        'all_to_all'
    """

    method: str = "ring"
    """``ring``: K/V passed around the cp ranks, each step overlapped with attention (no
    constraint on heads); ``all_to_all`` (Ulysses): heads scattered and the sequence
    gathered, one all-to-all before and after attention (heads must divide by cp)."""

    load_balanced: bool = True
    """Cut the sequence into ``2 cp`` chunks and give rank ``r`` chunks ``r`` and
    ``2 cp - 1 - r`` (causal attention then costs every rank the same)."""

    def __post_init__(self) -> None:
        if self.method not in CONTEXT_METHODS:
            raise ValueError(f"ContextParallel.method must be one of {CONTEXT_METHODS}, "
                             f"got {self.method!r}")
        _check_bool("ContextParallel", "load_balanced", self.load_balanced)


def _check_count(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}.{name} must be an integer >= 1, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class LocalSGD:
    """Semi-synchronous training over ``dp_replicate``: each replica group takes ``every``
    optimizer steps alone (no communication across groups), then the groups average
    their parameters.

    Example:
        >>> LocalSGD(every=8).every
        8
    """

    every: int
    """Optimizer steps between two averages (H); 1 averages after every step."""

    def __post_init__(self) -> None:
        _check_count("LocalSGD", "every", self.every)


COMM_DTYPES = (None, "bf16", "int8")
"""How DiLoCo sends pseudo-gradients: None (their own dtype), ``"bf16"`` or ``"int8"``."""


@dataclass(frozen=True, kw_only=True)
class DiLoCo:
    """DiLoCo over ``dp_replicate``: each replica group takes ``every`` optimizer steps
    alone; then the groups average their pseudo-gradients (the last synchronised
    parameters minus their own) and an outer SGD with Nesterov momentum steps the
    synchronised parameters, which every group continues from.

    Example:
        >>> DiLoCo(every=100, fragments=4).fragments
        4
    """

    every: int
    """Inner optimizer steps between two outer steps (H)."""

    outer_lr: float = 0.7
    """The outer SGD's learning rate (DiLoCo's 0.7; 1 with momentum 0 is local SGD)."""

    outer_momentum: float = 0.9
    """The outer SGD's momentum, in [0, 1)."""

    nesterov: bool = True
    """Nesterov momentum for the outer step."""

    fragments: int = 1
    """Streaming DiLoCo: the parameters cut into this many fragments (consecutive FSDP
    units / blocks), fragment ``j`` synchronised ``j * every / fragments`` steps before
    fragment 0, so each sync sends only its share. Must divide ``every``."""

    overlap: bool = False
    """Send each fragment's pseudo-gradient while the next inner step runs and apply the
    outer step after it (one step stale: that fragment's inner update of the overlapped
    step is replaced by the synchronised value)."""

    comm_dtype: str | None = None
    """``"bf16"`` sends the pseudo-gradients in bfloat16 (half the bytes); ``"int8"``
    quantizes each group's with its own scale (``max|p| / 127``) and all-gathers them
    (``R - 1`` bytes sent per parameter: a quarter of float32 at R = 2, as many as
    bfloat16 at R = 4); None in their own dtype."""

    def __post_init__(self) -> None:
        _check_count("DiLoCo", "every", self.every)
        _check_count("DiLoCo", "fragments", self.fragments)
        lr, momentum = self.outer_lr, self.outer_momentum
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
            raise ValueError(f"DiLoCo.outer_lr must be a number > 0, got {lr!r}")
        if (isinstance(momentum, bool) or not isinstance(momentum, (int, float))
                or not 0 <= momentum < 1):
            raise ValueError(f"DiLoCo.outer_momentum must be in [0, 1), got {momentum!r}")
        _check_bool("DiLoCo", "nesterov", self.nesterov)
        _check_bool("DiLoCo", "overlap", self.overlap)
        if self.every % self.fragments:
            raise ValueError(f"DiLoCo.fragments={self.fragments} must divide "
                             f"every={self.every} (the fragments sync at evenly staggered "
                             "steps); choose a divisor")
        if self.overlap and self.every == 1:
            raise ValueError("DiLoCo.overlap needs every >= 2 (the overlapped inner step of a "
                             "fragment is replaced by its outer step); raise every or drop "
                             "overlap")
        if self.comm_dtype not in COMM_DTYPES:
            raise ValueError(f"DiLoCo.comm_dtype must be None, 'bf16' or 'int8', "
                             f"got {self.comm_dtype!r}")


SEMI_SYNC = (LocalSGD, DiLoCo)
"""The semi-synchronous modes ``Parallel(semi_sync=...)`` takes."""


def changed_fields(options: Any) -> dict[str, Any]:
    """The fields of an options dataclass that differ from their defaults."""
    return {f.name: getattr(options, f.name) for f in fields(options)
            if getattr(options, f.name) != f.default}
