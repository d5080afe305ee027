"""``hybrid``'s layouts for the planner: ``pipeline x replicate x shard x tensor``.

A layout is a :class:`~paratrain.distributed.mesh.ParallelDegrees`, validated as the
runtime validates it. Its cost is composed from the other strategies' pieces in
:mod:`paratrain.plan.costs`: the pipeline's stage split and schedule, tensor parallel's
per-block all-reduces, FSDP's all-gathers and reduce-scatters and HSDP's replica
all-reduce, each over the links its mesh axis crosses. Ranks are placed as the runtime's
mesh places them: tensor innermost, then shard, replicate, and pipeline outermost.
Every formula is written out in ``docs/plan.md``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from paratrain.distributed.mesh import ParallelDegrees
from paratrain.plan.comm import (
    allgather_bytes,
    allgather_time,
    allreduce_bytes,
    allreduce_time,
    exposed_comm_time,
    reduce_scatter_time,
)
from paratrain.plan.costs import (
    Cost,
    PlanOptions,
    _microbatches,
    _pipeline_step,
    _slowest_link,
    _stage_split,
    _tp_comm,
    tp_share,
    without_tp_traffic,
)
from paratrain.plan.types import Hardware, ModelProfile

AXES = ("pipeline", "replicate", "shard", "tensor")
"""The axes ``hybrid``'s layouts are costed on (context and expert parallel are costed by
:mod:`paratrain.plan.context_experts`)."""

__all__ = ["LAYOUT_KEYS", "candidate_layouts", "default_layout", "group_hardware",
           "layout_cost", "layout_dict", "parse_layout", "resolve_layout"]

LAYOUT_KEYS: dict[str, str] = {
    "pp": "pipeline_degree", "pipeline": "pipeline_degree",
    "dp_replicate": "replicate_degree", "replicate": "replicate_degree",
    "dp_shard": "shard_degree", "shard": "shard_degree",
    "tp": "tensor_degree", "tensor": "tensor_degree",
}
"""The names ``--layout`` accepts for each degree."""


def parse_layout(text: str) -> dict[str, int]:
    """``"pp=2,dp_shard=2,tp=2"`` -> ``{"pipeline_degree": 2, "shard_degree": 2,
    "tensor_degree": 2}``; degrees left out are inferred by :func:`resolve_layout`."""
    degrees: dict[str, int] = {}
    for part in str(text).split(","):
        key, sep, value = (x.strip() for x in part.partition("="))
        if not sep or not key:
            raise ValueError(f"expected NAME=N pairs such as pp=2,dp_shard=2,tp=2, got {text!r}")
        if key.lower() not in LAYOUT_KEYS:
            raise ValueError(f"unknown degree {key!r}; choose from pp, dp_replicate, dp_shard, tp")
        name = LAYOUT_KEYS[key.lower()]
        if name in degrees:
            raise ValueError(f"{key} is given twice in {text!r}")
        try:
            degrees[name] = int(value)
        except ValueError:
            raise ValueError(f"{key} must be a positive integer, got {value!r}") from None
        if degrees[name] < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return degrees


def default_layout(hw: Hardware) -> ParallelDegrees:
    """``hybrid``'s layout without options: HSDP, a node's devices shard, nodes replicate."""
    return ParallelDegrees(replicate_degree=hw.num_nodes, shard_degree=hw.num_devices_per_node)


def resolve_layout(layout: ParallelDegrees | Mapping[str, int], hw: Hardware) -> ParallelDegrees:
    """The full layout on ``hw``: degrees left out of a mapping are inferred as the runtime's
    ``hybrid`` infers them (shard: the devices per node without a pipeline, 1 with one;
    replicate: what is left). ValueError naming the bad degree otherwise."""
    w = hw.world_size
    if isinstance(layout, ParallelDegrees):
        degrees = layout
        degrees.validate(w)
    elif isinstance(layout, Mapping):
        unknown = [k for k in layout if k not in {f"{a}_degree" for a in AXES}]
        if unknown:
            raise ValueError(f"layout: unknown degree(s) {', '.join(map(repr, unknown))}")
        pipeline = layout.get("pipeline_degree", 1)
        _check_tensor(layout.get("tensor_degree", 1), pipeline)
        shard = layout.get("shard_degree")
        if shard is None and isinstance(pipeline, int):
            shard = 1 if pipeline > 1 else hw.num_devices_per_node
        degrees = ParallelDegrees.infer(
            world_size=w, pipeline_degree=pipeline, shard_degree=shard,
            replicate_degree=layout.get("replicate_degree"),
            tensor_degree=layout.get("tensor_degree", 1))
    else:
        raise ValueError(f"layout must be a ParallelDegrees or a mapping of degrees, got "
                         f"{type(layout).__name__}")
    _check_tensor(degrees.tensor_degree, degrees.pipeline_degree)
    return degrees


def _check_tensor(tensor: object, pipeline: object) -> None:
    # As HybridOptions refuses it: without a pipeline, shard x tensor is strategy fsdp_tp.
    if isinstance(tensor, int) and tensor > 1 and pipeline == 1:
        raise ValueError(f"tensor_degree={tensor} needs pipeline_degree > 1: hybrid splits "
                         "layers only inside a pipeline (fsdp_tp runs shard x tensor)")


def layout_dict(degrees: ParallelDegrees) -> dict[str, int]:
    """JSON-ready degrees, outermost first."""
    return {f"{a}_degree": getattr(degrees, f"{a}_degree") for a in AXES}


def candidate_layouts(hw: Hardware, *, num_layers: int) -> list[ParallelDegrees]:
    """Every layout ``hybrid`` can run on ``hw``, simplest first: degrees dividing the world
    size, the tensor degree dividing a node (its all-reduces stay on the fast link) and
    only inside a pipeline, at most ``num_layers`` stages."""
    w, n = hw.world_size, hw.num_devices_per_node
    found = []
    for p in _divisors(w):
        for t in _divisors(math.gcd(n, w // p)):
            if p > num_layers or (t > 1 and p == 1):
                continue
            for s in _divisors(w // (p * t)):
                found.append(ParallelDegrees(pipeline_degree=p, replicate_degree=w // (p * t * s),
                                             shard_degree=s, tensor_degree=t))
    # Fewer split axes first, then shallower pipelines: on a tie the simpler layout wins.
    return sorted(found, key=lambda d: (sum(x > 1 for x in d.shape), d.pipeline_degree,
                                        d.tensor_degree, -d.shard_degree))


def _divisors(x: int) -> list[int]:
    return [d for d in range(1, x + 1) if x % d == 0]


def group_hardware(hw: Hardware, *, size: int, stride: int) -> Hardware:
    """The links of one group of ``size`` ranks ``stride`` apart, as a cluster of its own:
    within a node, spread evenly over whole nodes (hierarchical collectives, as
    :mod:`paratrain.plan.comm` models them), or straddling nodes unevenly (a flat ring at
    the inter-node link)."""
    n, k = hw.num_devices_per_node, hw.num_nodes
    extent = size * stride
    if size == 1 or k == 1 or n % extent == 0:
        return replace(hw, num_devices_per_node=size, num_nodes=1)
    if n % stride == 0 and extent % n == 0:
        per_node = n // stride
        return replace(hw, num_devices_per_node=per_node, num_nodes=size // per_node)
    if stride % n == 0:
        return replace(hw, num_devices_per_node=1, num_nodes=size)
    return replace(hw, num_devices_per_node=size, num_nodes=1,
                   intra_node_bandwidth=hw.inter_node_bandwidth,
                   intra_node_latency=hw.inter_node_latency)


def layout_cost(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions,
                degrees: ParallelDegrees) -> Cost:
    """One step of ``hybrid`` in the layout ``degrees`` (``b`` samples per data-parallel
    rank and pipeline stage, as ``pipeline`` and ``tp`` count them); not applicable
    with a tensor degree whose traffic is unknown (see ``without_tp_traffic``)."""
    degrees.validate(hw.world_size)
    return without_tp_traffic(_layout_cost(pr, hw, b, o, degrees), pr, degrees.tensor_degree)


def _layout_cost(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions,
                 degrees: ParallelDegrees) -> Cost:
    p, r, s, _, t = degrees.shape
    w, layers = hw.world_size, pr.num_layers
    note = f"pipeline {p} x replicate {r} x shard {s} x tensor {t}"
    # Each stage's tensor-rank part of a layer (1/t of the split parameters, all of the
    # replicated ones) is one FSDP unit, sharded over s and replicated over r.
    shard_hw = group_hardware(hw, size=s, stride=t)
    rep_hw = group_hardware(hw, size=r, stride=s * t)
    held = tp_share(pr.tp_split_param_fraction, t)
    ag = allgather_time(pr.param_size / layers * held, shard_hw)
    rs = reduce_scatter_time(pr.grad_size / layers * held, shard_hw)
    ar = allreduce_time(pr.grad_size / layers * held / s, rep_hw)
    sharded = dict(devices=w, optimizer_divisor=p * t * s, shard_devices=p * s,
                   tensor_held=held)
    if p == 1:
        return _unpipelined(pr, hw, b, o, degrees, ag=ag, rs=rs, ar=ar, note=note,
                            traffic=2 * allgather_bytes(pr.param_size * held, shard_hw)
                            + allgather_bytes(pr.grad_size * held, shard_hw)
                            + allreduce_bytes(pr.grad_size * held / s, rep_hw), **sharded)
    batch = b * p  # one pipeline's mini-batch, as strategy pipeline counts it
    m = _microbatches(o, p, batch)
    chain = len(pr.chain) or layers
    if chain < p:
        return Cost(batch=batch * r * s,
                    compute=b * pr.step_compute_time_per_sample * tp_share(pr.tp_split_fraction, t),
                    applicable=False, note=f"{note}: needs >= {p} layers, model has {chain}",
                    **sharded)
    micro = batch / m
    shares, boundary = _stage_split(pr, p, micro)
    # A tensor rank computes its part of the split work and all of the rest, plus
    # DTensor's fixed dispatch cost per step, spread over the stages' micro-batches.
    split = tp_share(pr.tp_split_fraction, t)
    dispatch = pr.tp_dispatch_time / (p * m) if t > 1 else 0.0
    work = [micro * pr.step_compute_time_per_sample * share * split + dispatch
            for share in shares]
    # The stage's share of the blocks does the tensor all-reduces of one micro-batch.
    tp_comm, tp_traffic = (x / p for x in _tp_comm(pr, hw, micro, t))
    # FSDP reshards after each forward and the pipelining stage keeps backward's gather
    # until the last micro-batch: about one all-gather of the stage per micro-batch, hidden
    # behind its forward except the first unit's.
    stage_layers = layers / p
    forward = pr.forward_time_per_sample / pr.step_compute_time_per_sample
    gathers = [exposed_comm_time(stage_layers * ag, x * forward, overlap=o.overlap, tail=ag)
               for x in work]
    slots = [x + tp_comm + g for x, g in zip(work, gathers, strict=True)]
    bw, lat = _slowest_link(hw)  # pipeline outermost: some boundary crosses nodes if any does
    p2p = lat + boundary / bw
    step = _pipeline_step(slots, p2p, m, o.overlap)
    busy = sum(work) + (m - 1) * max(work)  # the step without any communication
    compute = m * sum(work) / p
    # The pipelining stage reduces gradients after the last backward, with nothing left
    # to hide behind: per unit over shard (+ replicate) under FSDP, one flat all-reduce
    # over the replicas without it.
    reduce = (stage_layers * (rs + ar) if s > 1
              else allreduce_time(pr.grad_size / p * held, rep_hw))
    traffic = (2 * m * boundary + m * tp_traffic
               + m * allgather_bytes(pr.param_size / p * held, shard_hw)
               + allgather_bytes(pr.grad_size / p * held, shard_hw)
               + allreduce_bytes(pr.grad_size / p * held / s, rep_hw))
    return Cost(batch=batch * r * s, compute=compute,
                comm=2 * m * p2p + m * (tp_comm + stage_layers * ag) + reduce,
                exposed=max(0.0, step - busy) + reduce, bubble=busy - compute,
                bubble_fraction=(busy - compute) / busy if busy > 0 else 0.0,
                traffic=traffic, note=f"{note}, m={m}", **sharded)


def _unpipelined(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions,
                 degrees: ParallelDegrees, *, ag: float, rs: float, ar: float, note: str,
                 traffic: float, **sharded: int) -> Cost:
    # FSDP's overlap (as fsdp, hybrid's HSDP and fsdp_tp): forward gathers hide behind
    # forward except the first, backward's gathers, reduce-scatters and replica
    # all-reduces behind backward except the last unit's; tensor all-reduces hide nowhere.
    _, r, s, _, t = degrees.shape
    layers = pr.num_layers
    tp_comm, tp_traffic = _tp_comm(pr, hw, b, t)
    split = tp_share(pr.tp_split_fraction, t)
    exp_f = exposed_comm_time(layers * ag, b * pr.forward_time_per_sample * split,
                              overlap=o.overlap, tail=ag)
    exp_b = exposed_comm_time(layers * (ag + rs + ar), b * pr.backward_time_per_sample * split,
                              overlap=o.overlap, tail=rs + ar)
    runnable = t == 1
    dispatch = pr.tp_dispatch_time if t > 1 else 0.0
    return Cost(batch=r * s * b, compute=b * pr.step_compute_time_per_sample * split + dispatch,
                comm=tp_comm + layers * (2 * ag + rs + ar), exposed=tp_comm + exp_f + exp_b,
                traffic=tp_traffic + traffic, applicable=runnable,
                note=note if runnable else f"{note}: hybrid needs a pipeline for tensor > 1",
                **sharded)
