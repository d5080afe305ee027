"""Cost model behind ``paratrain plan``: step time and memory of each strategy.

Pure arithmetic, no processes (:func:`plan` only reads the runtime's strategy registry,
to mark what cannot run yet). Communication uses the alpha-beta model
(:mod:`paratrain.plan.comm`), memory the sharding table of :mod:`paratrain.plan.memory`,
and compute a :class:`ModelProfile` (usually measured by :func:`paratrain.plan.calibration`).
Every formula is written out in ``docs/plan.md``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from paratrain.distributed.partition import balanced_split
from paratrain.plan.comm import (
    DEFAULT_BUCKET_BYTES,
    allgather_bytes,
    allgather_time,
    allreduce_bytes,
    allreduce_time,
    ddp_buckets,
    exposed_comm_time,
    ps_comm_time,
    reduce_scatter_time,
)
from paratrain.plan.memory import memory_per_device, state_divisors
from paratrain.plan.report import (
    PlanReport,
    recommend,
)
from paratrain.plan.types import (
    Hardware,
    ModelProfile,
    Prediction,
    check_number,
    check_positive_int,
)

__all__ = ["STRATEGIES", "plan", "predict", "runnable_strategies"]

#: Strategies in the order they are reported.
STRATEGIES: tuple[str, ...] = ("single", "ddp", "ps", "fsdp", "zero1", "zero2", "pipeline", "dp")


@dataclass(frozen=True, kw_only=True)
class _Cost:
    devices: int
    batch: int
    compute: float
    comm: float = 0.0
    exposed: float = 0.0
    bubble: float = 0.0
    bubble_fraction: float = 0.0
    traffic: float = 0.0
    applicable: bool = True
    note: str = ""


def _cost(name: str, pr: ModelProfile, hw: Hardware, b: int, opts: dict[str, Any]) -> _Cost:
    w, ov = hw.world_size, opts["overlap"]
    compute = b * pr.step_compute_time_per_sample
    fwd, bwd = b * pr.forward_time_per_sample, b * pr.backward_time_per_sample
    sp, sg, layers = pr.param_size, pr.grad_size, pr.num_layers
    dp_kw: dict[str, Any] = {"devices": w, "batch": w * b, "compute": compute}
    if name == "single":
        return _Cost(devices=1, batch=b, compute=compute)
    if name in ("ddp", "zero1", "zero2"):
        # Buckets are reduced while backward runs; only the last one, ready when backward
        # ends, cannot hide. ZeRO-2 reduce-scatters instead of all-reducing.
        op = allreduce_time if name != "zero2" else reduce_scatter_time
        buckets = ddp_buckets(sg, layers, opts["bucket_bytes"])
        comm = sum(op(x, hw) for x in buckets)
        exposed = exposed_comm_time(comm, bwd, overlap=ov, tail=op(buckets[-1], hw))
        traffic = allreduce_bytes(sg, hw) if name != "zero2" else allgather_bytes(sg, hw)
        if name == "ddp":
            return _Cost(**dp_kw, comm=comm, exposed=exposed, traffic=traffic)
        # ZeRO-1/2: each rank updates its 1/N, then the new parameters are all-gathered.
        ag = allgather_time(sp, hw)
        return _Cost(**dp_kw, comm=comm + ag, exposed=exposed + ag,
                     traffic=traffic + allgather_bytes(sp, hw))
    if name == "fsdp":
        # One unit per layer. Forward all-gathers hide behind forward except the first; backward
        # all-gathers + reduce-scatters hide behind backward except the last reduce-scatter.
        ag, rs = allgather_time(sp / layers, hw), reduce_scatter_time(sg / layers, hw)
        exp_f = exposed_comm_time(layers * ag, fwd, overlap=ov, tail=ag)
        exp_b = exposed_comm_time(layers * (ag + rs), bwd, overlap=ov, tail=rs)
        return _Cost(**dp_kw, comm=layers * (2 * ag + rs), exposed=exp_f + exp_b,
                     traffic=2 * allgather_bytes(sp, hw) + allgather_bytes(sg, hw))
    if name == "ps":
        bw, lat = _slowest_link(hw)  # servers sit behind the inter-node link once there are nodes
        k = opts["num_servers"]
        comm = ps_comm_time(sg, sp, num_workers=w, num_servers=k, bandwidth=bw, latency=lat)
        # Workers keep no optimizer state: the servers apply the update.
        return _Cost(**dp_kw, comm=comm, exposed=comm, traffic=w * (sg + sp) / k, note=f"+{k} server(s)")
    if name == "pipeline":
        return _pipeline_cost(pr, hw, b, opts["num_microbatches"], opts["overlap"])
    # "dp": one process drives the node's devices; parameters are copied out of device 0 and
    # gradients copied back every step, serialized on device 0's link, with no overlap.
    n = hw.num_devices_per_node
    comm = (n - 1) * (sp + sg) / hw.intra_node_bandwidth + 2 * (n - 1) * hw.intra_node_latency
    return _Cost(devices=n, batch=n * b, compute=compute, comm=comm, exposed=comm,
                 traffic=(n - 1) * (sp + sg), note="one node only" if hw.num_nodes > 1 else "")


def _slowest_link(hw: Hardware) -> tuple[float, float]:
    if hw.num_nodes > 1:
        return hw.inter_node_bandwidth, hw.inter_node_latency
    return hw.intra_node_bandwidth, hw.intra_node_latency


def _pipeline_cost(pr: ModelProfile, hw: Hardware, b: int, m_opt: int | None,
                   overlap: float) -> _Cost:
    # p stages = all devices; the mini-batch is b * p samples (same global batch as DDP),
    # split into m micro-batches.
    p = hw.world_size
    batch = b * p
    m = min(4 * p, batch) if m_opt is None else m_opt
    if m > batch:
        raise ValueError(f"num_microbatches ({m}) must not exceed the mini-batch of {batch} samples")
    layers = len(pr.chain) or pr.num_layers
    if layers < p:
        return _Cost(devices=p, batch=batch, compute=b * pr.step_compute_time_per_sample,
                     applicable=False,
                     note=f"needs >= {p} layers, model has {layers}")
    micro = batch / m
    shares = [1.0 / p] * p  # of the model's compute, per stage
    if pr.chain and p > 1:
        # Cut as the pipeline strategy cuts (balanced parameters); the largest crossing
        # tensor sets the pace of the boundary transfers.
        cuts = balanced_split([params for params, _ in pr.chain], p)
        boundary = micro * max(pr.chain[i - 1][1] for i in cuts)
        total = sum(pr.chain_times)
        if total > 0:
            bounds = [0, *cuts, len(pr.chain)]
            shares = [sum(pr.chain_times[lo:hi]) / total for lo, hi in zip(bounds, bounds[1:])]
    else:
        boundary = micro * pr.activation_bytes_per_sample / pr.num_layers
    # One stage's forward + backward of one micro-batch. Parameters balance the cut, not
    # compute: the slowest stage sets the pace.
    stage = [micro * pr.step_compute_time_per_sample * share for share in shares]
    slot_max, slot_sum = max(stage), sum(stage)
    bw, lat = _slowest_link(hw)  # the slowest stage boundary sets the pace
    p2p = 0.0 if p == 1 else lat + boundary / bw  # activation forward or its gradient backward
    # The first micro-batch passes every stage and crosses every boundary forward and back
    # with nothing to hide behind (fill and drain). In the steady state a stage computes
    # the next micro-batch while its sends are in flight, and activations and gradients
    # use the two directions of the link, so each further micro-batch costs
    # max(slowest stage, one transfer) when sends overlap compute and the slowest stage
    # plus both transfers when they do not.
    hidden = max(slot_max, p2p)
    serial = slot_max + 2 * p2p
    per_micro = overlap * hidden + (1 - overlap) * serial
    busy = slot_sum + (m - 1) * slot_max  # the step without transfers
    step = slot_sum + 2 * (p - 1) * p2p + (m - 1) * per_micro
    compute = m * slot_sum / p  # one device's work, on average
    return _Cost(devices=p, batch=batch, compute=compute, comm=2 * m * p2p,
                 exposed=max(0.0, step - busy), bubble=busy - compute,
                 bubble_fraction=(busy - compute) / busy if busy > 0 else 0.0,
                 traffic=0.0 if p == 1 else 2 * m * boundary, note=f"m={m}")


def runnable_strategies() -> frozenset[str]:
    """Planner strategies that ``Run(strategy=...)`` accepts: the runtime's registry.

    ZeRO-1/2 are modelled (they sit between DDP and FSDP) but no runtime strategy
    implements them yet, so :func:`plan` never recommends them.
    """
    from paratrain.strategies import available_strategies  # imports torch: only when planning

    return frozenset(STRATEGIES) & frozenset(available_strategies())


def predict(
    strategy: str, profile: ModelProfile, hardware: Hardware, *, batch_size_per_device: int,
    num_servers: int = 1, num_microbatches: int | None = None, overlap: float = 1.0,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES, runnable: frozenset[str] | None = None,
) -> Prediction:
    """Predict one strategy; see :func:`plan` for the arguments.

    ``runnable``: names the runtime implements; a strategy outside it is predicted but
    marked ``runnable=False`` (None: every strategy counts as runnable).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategies: unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    check_positive_int("batch_size_per_device", batch_size_per_device)
    check_positive_int("num_servers", num_servers)
    if num_microbatches is not None:
        check_positive_int("num_microbatches", num_microbatches)
    check_number("overlap", overlap, positive=False)
    if overlap > 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    check_number("bucket_bytes", bucket_bytes, positive=True)
    opts = {"num_servers": num_servers, "num_microbatches": num_microbatches,
            "overlap": overlap, "bucket_bytes": bucket_bytes}
    b = batch_size_per_device
    c = _cost(strategy, profile, hardware, b, opts)
    # Each device steps the optimizer over the state it holds; a synchronous parameter
    # server's workers wait while the k servers step their shards.
    opt_div = num_servers if strategy == "ps" else state_divisors(strategy, c.devices)[2]
    opt = profile.optimizer_step_time / opt_div
    step = c.compute + c.exposed + c.bubble + opt
    sps = c.batch / step
    # Reference: one device running the same per-device batch (profile already includes recompute).
    single_sps = b / (b * profile.step_compute_time_per_sample + profile.optimizer_step_time)
    memory = memory_per_device(strategy, profile, num_devices=c.devices, batch_size_per_device=b)
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
        runnable=runnable is None or strategy in runnable,
    )


def plan(
    profile: ModelProfile, hardware: Hardware, *, batch_size_per_device: int,
    strategies: list[str] | tuple[str, ...] | None = None, num_servers: int = 1,
    num_microbatches: int | None = None, overlap: float = 1.0,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES,
) -> PlanReport:
    """Predict every strategy in ``strategies`` (default: all of :data:`STRATEGIES`).

    ``num_servers``: parameter servers for "ps". ``num_microbatches``: for "pipeline"
    (default 4 x stages, capped at the mini-batch). ``overlap``: share of backward time
    that can hide gradient communication (1.0 = all of it except the last bucket).
    ``bucket_bytes``: DDP bucket size, i.e. the communication that cannot be hidden.
    """
    names = list(STRATEGIES if strategies is None else strategies)
    if not names:
        raise ValueError("strategies must name at least one strategy")
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown:
        raise ValueError(f"strategies: unknown {', '.join(map(repr, unknown))} "
                         f"(known: {', '.join(STRATEGIES)})")
    names = list(dict.fromkeys(names))  # drop duplicates, keep order
    runnable = runnable_strategies()
    preds = [predict(s, profile, hardware, batch_size_per_device=batch_size_per_device,
                     num_servers=num_servers, num_microbatches=num_microbatches,
                     overlap=overlap, bucket_bytes=bucket_bytes, runnable=runnable)
             for s in names]
    rec, reason = recommend(preds, hardware.device_memory_bytes)
    settings = {"strategies": names, "num_servers": num_servers,
                "num_microbatches": num_microbatches, "overlap": overlap,
                "bucket_bytes": bucket_bytes}
    return PlanReport(profile=profile, hardware=hardware,
                      batch_size_per_device=batch_size_per_device, settings=settings,
                      predictions=preds, recommendation=rec, reason=reason)
