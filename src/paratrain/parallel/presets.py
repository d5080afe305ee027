"""Named strategies as presets of degrees, and the code that runs a resolved layout.

A preset is a name for a :class:`~paratrain.parallel.Parallel` (``ddp`` = replicate over
every rank, ``fsdp`` = shard over every rank, ...). :func:`choose` is the one place that
maps a resolved layout to the code that runs it, so a preset and its spelled-out degrees
run the same code and give the same losses (tests/parallel/test_presets.py).

``single``, ``dp``, ``mp`` and ``ps`` are strategies of their own: they do not compose
with degrees.

Example:
    >>> from paratrain.distributed.mesh import ParallelDegrees
    >>> choose(ParallelDegrees(shard_degree=2, tensor_degree=2), Parallel())
    ('fsdp_tp', {'tensor_degree': 2})
"""

from __future__ import annotations

from typing import Any

from paratrain.distributed.mesh import ParallelDegrees
from paratrain.parallel.degrees import Parallel, describe

NOT_COMPOSABLE = ("single", "dp", "mp", "ps")
"""Strategies that are not a layout of degrees (one process, or parameter servers)."""


def preset(name: str, options: dict[str, Any], *, local_world_size: int) -> Parallel | None:
    """The degrees the strategy ``name`` stands for; None for the non-composable ones."""
    if name in ("ddp", "zero1"):
        return Parallel(dp_replicate=-1)
    if name in ("fsdp", "zero2"):
        return Parallel(dp_shard=-1)
    if name == "tp":
        return Parallel(tp=-1)
    if name == "fsdp_tp":
        return Parallel(tp=int(options.get("tensor_degree", 2)), dp_shard=-1,
                        dp_replicate=int(options.get("replicate_degree", 1)))
    if name == "pipeline":
        return Parallel(pp=-1)
    if name == "hybrid":
        from paratrain.strategies.hybrid import default_shard_degree

        pipeline = int(options.get("pipeline_degree", 1))
        shard = options.get("shard_degree")
        if shard is None:
            shard = default_shard_degree(pipeline, local_world_size)
        replicate = options.get("replicate_degree")
        return Parallel(pp=pipeline, dp_shard=int(shard), tp=int(options.get("tensor_degree", 1)),
                        dp_replicate=-1 if replicate is None else int(replicate))
    return None


def choose(degrees: ParallelDegrees, parallel: Parallel) -> tuple[str, dict[str, Any]]:
    """The strategy that runs ``degrees`` and its options (from ``parallel``'s typed ones).

    Raises ValueError in one line for a combination that is not built yet.
    """
    pp, replicate, shard, tp = degrees.shape
    world = degrees.world_size
    tensor = parallel.tensor.as_options() if parallel.tensor else {}
    sharding = parallel.sharding.as_options() if parallel.sharding else {}
    pipeline = parallel.pipeline.as_options() if parallel.pipeline else {}
    if pp > 1:
        if pp == world:
            return "pipeline", pipeline
        return "hybrid", _drop_empty(pipeline_degree=pp, shard_degree=shard,
                                     replicate_degree=replicate, tensor_degree=tp,
                                     pipeline=pipeline, fsdp=sharding, tensor=tensor)
    if tp > 1:
        if replicate > 1 and shard == 1:
            raise ValueError(f"layout {describe(degrees)}: dp_replicate x tp needs dp_shard > 1 "
                             "(HSDP x TP) or a pipeline; use dp_shard instead of dp_replicate "
                             f"(dp_shard={replicate * shard},tp={tp})")
        if tp == world:
            return "tp", tensor
        extra = sorted(set(sharding) - {"reshard_after_forward"})
        if extra:
            raise ValueError(f"layout {describe(degrees)}: Sharding({extra[0]}=...) is not "
                             "available with tp yet; only reshard_after_forward is")
        replicas = {"replicate_degree": replicate} if replicate > 1 else {}
        return "fsdp_tp", {"tensor_degree": tp, **replicas, **tensor, **sharding}
    if shard > 1 and replicate > 1:
        return "hybrid", _drop_empty(shard_degree=shard, replicate_degree=replicate,
                                     fsdp=sharding)
    if shard > 1:
        return "fsdp", sharding
    return ("ddp" if world > 1 else "single"), {}


def _drop_empty(**options: Any) -> dict[str, Any]:
    return {name: value for name, value in options.items() if value not in ({}, None)}


def resolve_strategy(name: str, options: dict[str, Any], parallel: Any, *, world_size: int,
                     local_world_size: int) -> tuple[str, dict[str, Any]]:
    """The strategy and options a run uses, given ``Run(strategy=, strategy_options=,
    parallel=)``.

    Without ``parallel`` nothing changes. With it, ``auto`` becomes the code that runs
    the degrees (:func:`choose`); a preset must describe the same degrees (then the
    preset runs, with its options), else one line names both.
    """
    if parallel is None:
        return name, options
    layout = Parallel.parse(parallel)
    degrees = layout.resolve(world_size=world_size, local_world_size=local_world_size)
    if name in NOT_COMPOSABLE:
        raise ValueError(f"strategy {name!r} is not a layout of degrees and does not take "
                         f"parallel={str(layout)!r}; drop one of them")
    chosen, typed = choose(degrees, layout)
    if name == "auto":
        return chosen, _merge(typed, options)
    meant = preset(name, options, local_world_size=local_world_size)
    if meant is None:
        raise ValueError(f"unknown strategy {name!r} with parallel={str(layout)!r}; use "
                         "strategy='auto' (the default) with parallel=")
    meant_degrees = meant.resolve(world_size=world_size, local_world_size=local_world_size)
    if meant_degrees != degrees:
        raise ValueError(f"strategy {name!r} means {describe(meant_degrees)} on {world_size} "
                         f"processes but parallel= says {describe(degrees)}; drop one of them")
    if any((layout.tensor, layout.sharding, layout.pipeline)) and chosen != name:
        raise ValueError(f"strategy {name!r} takes its options in strategy_options; give "
                         "Parallel's typed options with strategy='auto'")
    return name, _merge(typed if chosen == name else {}, options)


def _merge(typed: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    both = sorted(set(typed) & set(options))
    if both:
        raise ValueError(f"option {both[0]!r} is set both by parallel= and by "
                         "strategy_options; set it once")
    return {**typed, **options}
