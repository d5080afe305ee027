"""Named strategies as presets of degrees, and the one choice of what runs a layout.

A preset is a name for a :class:`~paratrain.parallel.Parallel` (``fsdp`` = shard over
every rank, ``fsdp_tp`` = tensor parallel inside groups of ``tensor_degree`` ranks and
sharding across them, ...). Its ``strategy_options`` are the typed options' fields
(``fsdp``: :class:`~paratrain.parallel.options.Sharding`'s, ``tp``:
:class:`~paratrain.parallel.options.TensorParallel`'s), plus the degrees it names:
:func:`preset` expands them into one ``Parallel``. Every composed layout then runs the
one layout strategy; only a pure-replicate layout keeps ``ddp`` (its comm hooks and
unused-parameter options), and ``single``, ``dp``, ``mp``, ``ps`` and ``zero1`` are
strategies of their own.

Example:
    >>> preset("fsdp_tp", {"tensor_degree": 2}, local_world_size=8).resolve(world_size=8).shape
    (1, 1, 4, 1, 2)
    >>> layout_name(Parallel.parse("dp_shard=2,cp=2").resolve(world_size=4))
    'fsdp'
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, make_dataclass, replace
from dataclasses import field as dataclass_field
from typing import Any

from paratrain.distributed.mesh import ParallelDegrees
from paratrain.parallel.degrees import Parallel, describe
from paratrain.parallel.options import Pipeline, Sharding, TensorParallel, changed_fields

NOT_COMPOSABLE = ("single", "dp", "mp", "ps")
"""Strategies that are not a layout of degrees (one process, or parameter servers)."""

REPLICATED = ("ddp", "zero1")
"""Strategies of their own for a pure-replicate layout."""


def _preset_options(name: str, parts: tuple[type, ...], *, extra: tuple = (),
                    renames: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> type:
    """A preset's ``strategy_options`` dataclass, generated from the typed options' fields
    (so each option is declared once), with ``extra`` degree fields and ``renames``."""
    renames = renames or {}
    specs = []
    for part in parts:
        for f in fields(part):
            if f.name in drop:
                continue
            default = {"default": f.default} if f.default is not MISSING else {}
            specs.append((renames.get(f.name, f.name), f.type, dataclass_field(**default)))
    specs += [(n, t, dataclass_field(default=d)) for n, t, d in extra]
    return make_dataclass(name, specs, frozen=True, kw_only=True,
                          namespace={"__module__": __name__,
                                     "__doc__": f"``strategy_options`` of a preset: the fields "
                                                f"of {', '.join(p.__name__ for p in parts)}."})


ZeroTwoOptions = _preset_options("ZeroTwoOptions", (Sharding,), drop=("reshard_after_forward",))
ShardedTensorOptions = _preset_options(
    "ShardedTensorOptions", (TensorParallel,),
    extra=(("tensor_degree", "int", 2), ("replicate_degree", "int", 1),
           ("reshard_after_forward", "bool", True)))
PipelinePresetOptions = _preset_options("PipelinePresetOptions", (Pipeline,),
                                        renames={"microbatches": "num_microbatches"})


@dataclass(frozen=True, kw_only=True)
class HybridOptions:
    """``strategy_options`` of ``hybrid``: degrees (None: inferred) and dicts of the typed
    options' fields."""

    pipeline_degree: int = 1
    """Pipeline stages."""

    shard_degree: int | None = None
    """FSDP shard size; default: the processes per node without a pipeline (HSDP), 1 with one."""

    tensor_degree: int = 1
    """Tensor-parallel ranks per stage."""

    replicate_degree: int | None = None
    """Replicas; default: what is left of the world."""

    pipeline: dict[str, Any] = dataclass_field(default_factory=dict)
    """Fields of the pipeline's options, e.g. ``{"schedule": "gpipe"}`` (``num_microbatches``)."""

    fsdp: dict[str, Any] = dataclass_field(default_factory=dict)
    """Fields of :class:`Sharding`, e.g. ``{"reshard_after_forward": False}``."""

    tensor: dict[str, Any] = dataclass_field(default_factory=dict)
    """Fields of :class:`TensorParallel`, e.g. ``{"plan": {...}}``."""

    def __post_init__(self) -> None:
        ParallelDegrees(pipeline_degree=self.pipeline_degree, tensor_degree=self.tensor_degree)
        if self.pipeline and self.pipeline_degree == 1:
            raise ValueError("pipeline options need pipeline_degree > 1")
        if self.tensor and self.tensor_degree == 1:
            raise ValueError("tensor options need tensor_degree > 1")
        if self.fsdp and self.pipeline_degree > 1 and self.shard_degree in (None, 1):
            raise ValueError("fsdp options inside a pipeline need shard_degree > 1")


PRESET_OPTIONS: dict[str, type] = {
    "fsdp": Sharding, "zero2": ZeroTwoOptions, "tp": TensorParallel,
    "fsdp_tp": ShardedTensorOptions, "pipeline": PipelinePresetOptions, "hybrid": HybridOptions}
"""Each layout preset's ``strategy_options`` dataclass."""


def default_shard_degree(pipeline_degree: int, local_world_size: int) -> int:
    """``hybrid``'s shard degree when none is given: a node's processes (HSDP) without a
    pipeline, 1 with one (the stages already split the model)."""
    return 1 if pipeline_degree > 1 else local_world_size


def _pipeline(options: dict[str, Any]) -> Pipeline | None:
    options = dict(options)
    if "num_microbatches" in options:
        options["microbatches"] = options.pop("num_microbatches")
    return Pipeline(**options)


def _typed(options: Any) -> dict[str, Any]:
    return {f.name: getattr(options, f.name) for f in fields(options)}


def preset(name: str, options: Any, *, local_world_size: int) -> Parallel | None:
    """The layout the strategy ``name`` stands for, its options typed; None for the
    strategies that are not layouts. ``options``: a dict or the preset's dataclass."""
    if not isinstance(options, dict):
        options = _typed(options)
    if name in REPLICATED:
        return Parallel(dp_replicate=-1)
    if name == "fsdp":
        return Parallel(dp_shard=-1, sharding=Sharding(**options))
    if name == "zero2":
        return Parallel(dp_shard=-1, sharding=Sharding(reshard_after_forward=False, **options))
    if name == "tp":
        return Parallel(tp=-1, tensor=TensorParallel(**options))
    if name == "fsdp_tp":
        options = dict(options)
        tp, replicas = options.pop("tensor_degree", 2), options.pop("replicate_degree", 1)
        reshard = options.pop("reshard_after_forward", True)
        return Parallel(tp=tp, dp_shard=-1, dp_replicate=replicas,
                        tensor=TensorParallel(**options),
                        sharding=Sharding(reshard_after_forward=reshard))
    if name == "pipeline":
        return Parallel(pp=-1, pipeline=_pipeline(options))
    if name == "hybrid":
        h = options if isinstance(options, HybridOptions) else HybridOptions(**options)
        shard = h.shard_degree
        if shard is None:
            shard = default_shard_degree(h.pipeline_degree, local_world_size)
        return Parallel(pp=h.pipeline_degree, dp_shard=shard, tp=h.tensor_degree,
                        dp_replicate=-1 if h.replicate_degree is None else h.replicate_degree,
                        pipeline=_pipeline(h.pipeline) if h.pipeline else None,
                        sharding=Sharding(**h.fsdp) if h.fsdp else None,
                        tensor=TensorParallel(**h.tensor) if h.tensor else None)
    return None


def choose(degrees: ParallelDegrees) -> str:
    """What runs ``degrees``: ``single`` (one process), ``ddp`` (pure replicate) or
    ``layout`` (every other composition, one strategy)."""
    if degrees.world_size == 1:
        return "single"
    if degrees.world_size == degrees.replicate_degree:
        return "ddp"
    return "layout"


def layout_name(degrees: ParallelDegrees) -> str:
    """The preset a layout is known by in messages and checkpoints (``fsdp``, ``tp``,
    ``fsdp_tp``, ``pipeline``, ``hybrid``)."""
    pp, replicate, shard, _cp, tp = degrees.shape
    if pp > 1:
        return "pipeline" if pp == degrees.world_size else "hybrid"
    if tp > 1:
        return "tp" if tp == degrees.world_size else "fsdp_tp"
    if replicate > 1 and shard > 1:
        return "hybrid"
    return "fsdp" if shard > 1 or degrees.context_degree > 1 else choose(degrees)


@dataclass(frozen=True)
class Resolved:
    """What a run builds: the strategy's name, its options (a strategy of its own) or
    the layout (the layout strategy)."""

    name: str
    options: dict[str, Any]
    layout: Parallel | None = None


def resolve_strategy(name: str, options: dict[str, Any], parallel: Any, *, world_size: int,
                     local_world_size: int, replica_groups: int = 1) -> Resolved:
    """What a run uses, given ``Run(strategy=, strategy_options=, parallel=)``.

    Without ``parallel`` the strategy runs with its options (a layout preset expands to
    its layout when built). With it, ``auto`` runs the degrees; a preset must describe
    the same degrees, and its options join the typed ones (an option set by both is
    refused in one line).
    """
    if parallel is None:
        return Resolved(name, options)
    layout = Parallel.parse(parallel)
    degrees = layout.resolve(world_size=world_size, local_world_size=local_world_size,
                             replica_groups=replica_groups)
    if name in NOT_COMPOSABLE:
        raise ValueError(f"strategy {name!r} is not a layout of degrees and does not take "
                         f"parallel={str(layout)!r}; drop one of them")
    if name == "auto":
        chosen = choose(degrees)
        if chosen != "layout" and not _has_options(layout):
            return Resolved(chosen, dict(options))
        named = layout_name(degrees)
        # Replicas that sync every H steps (semi_sync) run in the layout strategy, not DDP.
        named = "hybrid" if named in REPLICATED else named
        return Resolved(named, {}, _with_options(layout, name, options))
    meant = preset(name, options, local_world_size=local_world_size)
    if meant is None:
        raise ValueError(f"unknown strategy {name!r} with parallel={str(layout)!r}; use "
                         "strategy='auto' (the default) with parallel=")
    meant_degrees = meant.resolve(world_size=world_size, local_world_size=local_world_size,
                                  replica_groups=replica_groups)
    if meant_degrees != degrees:
        raise ValueError(f"strategy {name!r} means {describe(meant_degrees)} on {world_size} "
                         f"processes but parallel= says {describe(degrees)}; drop one of them")
    if name in REPLICATED:
        if layout.semi_sync is not None:
            raise ValueError(f"strategy {name!r} averages gradients at every step; "
                             f"semi_sync={type(layout.semi_sync).__name__} runs in the layout "
                             "strategy: use strategy='auto' (the default)")
        if _has_options(layout):
            raise ValueError(f"strategy {name!r} means {describe(meant_degrees)}, without "
                             "typed options; drop parallel='s options or the strategy")
        return Resolved(name, dict(options))
    return Resolved(name, {}, _merged(layout, meant))


def _has_options(layout: Parallel) -> bool:
    return any(getattr(layout, f) is not None for f in ("tensor", "sharding", "pipeline",
                                                         "context", "semi_sync"))


def _with_options(layout: Parallel, name: str, options: dict[str, Any]) -> Parallel:
    if options:
        raise ValueError(f"strategy_options {sorted(options)} need a named strategy; with "
                         "parallel= give Parallel's typed options (tensor=, sharding=, ...)")
    return layout


def _merged(layout: Parallel, meant: Parallel) -> Parallel:
    """``layout`` with the preset's typed options joined in (each set once)."""
    updates = {}
    for field in ("tensor", "sharding", "pipeline"):
        given, preset_options = getattr(layout, field), getattr(meant, field)
        if preset_options is None or not changed_fields(preset_options):
            continue
        if given is not None:
            both = sorted(set(changed_fields(given)) & set(changed_fields(preset_options)))
            if both:
                raise ValueError(f"option {both[0]!r} is set both by parallel= and by "
                                 "strategy_options; set it once")
            preset_options = replace(preset_options, **changed_fields(given))
        updates[field] = preset_options
    return replace(layout, **updates) if updates else layout
