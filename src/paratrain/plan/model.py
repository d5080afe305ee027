"""The planner behind ``paratrain plan``: step time and memory of each strategy.

Pure arithmetic, no processes. The strategies, their order and their cost models come
from the strategy table (:mod:`paratrain.strategies.table`), so the planner offers
exactly what ``Run`` can run; a strategy without a cost model gets a "not modelled" row
that is never recommended. The cost models live in :mod:`paratrain.plan.costs`,
communication in :mod:`paratrain.plan.comm`, memory in :mod:`paratrain.plan.memory`, and
compute comes from a :class:`ModelProfile` (usually measured by
:func:`paratrain.plan.calibration`). Every formula is written out in ``docs/plan.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from paratrain.distributed.mesh import ParallelDegrees
from paratrain.plan.comm import DEFAULT_BUCKET_BYTES
from paratrain.plan.costs import PlanOptions
from paratrain.plan.layouts import (
    candidate_layouts,
    default_layout,
    layout_cost,
    layout_dict,
    resolve_layout,
)
from paratrain.plan.memory import memory_per_device
from paratrain.plan.report import TIE_MARGIN, PlanReport, recommend
from paratrain.plan.types import (
    Hardware,
    ModelProfile,
    Prediction,
    check_number,
    check_positive_int,
)
from paratrain.strategies.table import strategy_entry, strategy_names

__all__ = ["STRATEGIES", "best_layout", "plan", "predict"]

#: Every strategy ``Run`` accepts, in the table's order (the order they are reported).
STRATEGIES: tuple[str, ...] = strategy_names()


def _check_names(names: list[str]) -> None:
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"strategies: unknown {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(STRATEGIES)})")


def _not_modelled(strategy: str, reason: str, hardware: Hardware, b: int) -> Prediction:
    w = hardware.world_size
    return Prediction(
        strategy=strategy, num_devices=w, global_batch_size=w * b, step_time=0.0,
        compute_time=0.0, comm_time=0.0, exposed_comm_time=0.0, bubble_time=0.0,
        bubble_fraction=0.0, traffic_bytes=0.0, samples_per_second=0.0, scaling_efficiency=0.0,
        param_memory=0.0, grad_memory=0.0, optimizer_memory=0.0, activation_memory=0.0,
        memory_bytes=0.0, fits=None, applicable=False, note=reason, modelled=False)


def predict(
    strategy: str, profile: ModelProfile, hardware: Hardware, *, batch_size_per_device: int,
    num_servers: int = 1, num_microbatches: int | None = None, overlap: float = 1.0,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES,
    layout: ParallelDegrees | Mapping[str, int] | None = None,
) -> Prediction:
    """Predict one strategy with its cost model; see :func:`plan` for the arguments.

    A strategy the table marks not modelled gets ``modelled=False``, zeros and the
    reason in ``note``. ``layout`` (``hybrid`` only): the degrees to cost, or some of them
    with the rest inferred as the runtime infers them; None: ``hybrid``'s default HSDP.
    """
    _check_names([strategy])
    if layout is not None and strategy != "hybrid":
        raise ValueError(f"layout applies to strategy 'hybrid' only, not {strategy!r}")
    degrees = None if layout is None else resolve_layout(layout, hardware)
    check_positive_int("batch_size_per_device", batch_size_per_device)
    check_positive_int("num_servers", num_servers)
    if num_microbatches is not None:
        check_positive_int("num_microbatches", num_microbatches)
    check_number("overlap", overlap, positive=False)
    if overlap > 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    check_number("bucket_bytes", bucket_bytes, positive=True)
    b = batch_size_per_device
    entry = strategy_entry(strategy)
    if not entry.modelled:
        return _not_modelled(strategy, entry.not_modelled, hardware, b)
    model = entry.load_cost_model()
    options = PlanOptions(num_servers=num_servers, num_microbatches=num_microbatches,
                          overlap=overlap, bucket_bytes=bucket_bytes)
    # hybrid's cost model is its default layout; a given layout is costed here, as the
    # layouts build on the cost models (and the table names one model per strategy).
    c = (model.cost(profile, hardware, b, options) if degrees is None
         else layout_cost(profile, hardware, b, options, degrees))
    # The devices (or servers) that share the optimizer step run their parts at once.
    opt = profile.optimizer_step_time / c.optimizer_divisor
    step = c.compute + c.exposed + c.bubble + opt
    sps = c.batch / step
    # Reference: one device running the same per-device batch (profile already includes recompute).
    single_sps = b / (b * profile.step_compute_time_per_sample + profile.optimizer_step_time)
    memory = memory_per_device(model.sharding, profile, num_devices=c.shard_devices or c.devices,
                               batch_size_per_device=b, tensor_held=c.tensor_held)
    mem = memory.total
    limit = hardware.device_memory_bytes
    return Prediction(
        strategy=strategy, num_devices=c.devices, global_batch_size=c.batch, step_time=step,
        compute_time=c.compute, comm_time=c.comm, exposed_comm_time=c.exposed,
        bubble_time=c.bubble, bubble_fraction=c.bubble_fraction, traffic_bytes=c.traffic,
        samples_per_second=sps, scaling_efficiency=sps / (c.devices * single_sps),
        param_memory=memory.param_memory, grad_memory=memory.grad_memory,
        optimizer_memory=memory.optimizer_memory, activation_memory=memory.activation_memory,
        memory_bytes=mem, fits=None if limit is None else mem <= limit,
        applicable=c.applicable, note=c.note, optimizer_time=opt,
        layout=(layout_dict(degrees or default_layout(hardware)) if strategy == "hybrid"
                else None),
    )


def plan(
    profile: ModelProfile, hardware: Hardware, *, batch_size_per_device: int,
    strategies: list[str] | tuple[str, ...] | None = None, num_servers: int = 1,
    num_microbatches: int | None = None, overlap: float = 1.0,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES,
    layout: ParallelDegrees | Mapping[str, int] | None = None, search_layouts: bool = True,
) -> PlanReport:
    """Predict every strategy in ``strategies`` (default: all of :data:`STRATEGIES`) and
    recommend the fastest modelled one that fits (near-ties go to the earlier in the table).

    ``num_servers``: parameter servers for "ps". ``num_microbatches``: for "pipeline"
    (default 4 x stages, capped at the mini-batch). ``overlap``: share of backward time
    that can hide gradient communication (1.0 = all of it except the last bucket).
    ``bucket_bytes``: DDP bucket size, i.e. the communication that cannot be hidden.
    ``layout``: cost ``hybrid`` in these degrees (see :func:`predict`). Without one and
    with ``search_layouts``, ``hybrid``'s row is its best layout (:func:`best_layout`).
    """
    names = list(STRATEGIES if strategies is None else strategies)
    if not names:
        raise ValueError("strategies must name at least one strategy")
    _check_names(names)
    names = list(dict.fromkeys(names))  # drop duplicates, keep order
    kwargs: dict[str, Any] = dict(
        batch_size_per_device=batch_size_per_device, num_servers=num_servers,
        num_microbatches=num_microbatches, overlap=overlap, bucket_bytes=bucket_bytes)
    preds = [best_layout(profile, hardware, **kwargs)
             if s == "hybrid" and layout is None and search_layouts
             else predict(s, profile, hardware, layout=layout if s == "hybrid" else None,
                          **kwargs)
             for s in names]
    rec, reason = recommend(preds, hardware.device_memory_bytes)
    given = (None if layout is None else layout_dict(layout)
             if isinstance(layout, ParallelDegrees) else dict(layout))
    settings = {"strategies": names, "num_servers": num_servers,
                "num_microbatches": num_microbatches, "overlap": overlap,
                "bucket_bytes": bucket_bytes, "layout": given,
                "search_layouts": search_layouts and layout is None}
    return PlanReport(profile=profile, hardware=hardware,
                      batch_size_per_device=batch_size_per_device, settings=settings,
                      predictions=preds, recommendation=rec, reason=reason)


def best_layout(profile: ModelProfile, hardware: Hardware, **kwargs: Any) -> Prediction:
    """``hybrid`` in its best layout on ``hardware``: the default HSDP and every layout of
    :func:`~paratrain.plan.layouts.candidate_layouts`, ranked as :func:`plan` ranks
    strategies (fastest that fits, near-ties to the default then the simpler layout;
    nothing fits: least memory). ``kwargs`` as :func:`predict`'s, without ``layout``."""
    default = default_layout(hardware)
    rows = [predict("hybrid", profile, hardware, **kwargs)]
    m, b = kwargs.get("num_microbatches"), kwargs["batch_size_per_device"]
    for degrees in candidate_layouts(hardware, num_layers=len(profile.chain) or profile.num_layers):
        if degrees == default or (m is not None and degrees.pipeline_degree > 1
                                  and m > b * degrees.pipeline_degree):
            continue  # the default is costed above; too many micro-batches: no such run
        rows.append(predict("hybrid", profile, hardware, layout=degrees, **kwargs))
    usable = [p for p in rows if p.applicable] or rows[:1]
    limit = hardware.device_memory_bytes
    fitting = [p for p in usable if limit is None or p.fits]
    if not fitting:
        return min(usable, key=lambda p: p.memory_bytes)  # the first, simplest, on a tie
    top = max(p.samples_per_second for p in fitting)
    return next(p for p in fitting if p.samples_per_second >= top * (1 - TIE_MARGIN))
