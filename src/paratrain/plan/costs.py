"""One cost model per strategy: the step's compute, communication and bubble, and what
each device holds.

The strategy table (:mod:`paratrain.strategies.table`) names each model by string, so
the runtime never imports the planner; :func:`paratrain.plan.model.predict` turns a
:class:`Cost` into a :class:`~paratrain.plan.types.Prediction`. Every formula is
written out in ``docs/plan.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

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
    ring_allgather_time,
    ring_allreduce_time,
    ring_reduce_scatter_time,
)
from paratrain.plan.types import Hardware, ModelProfile

__all__ = ["DDP", "DP", "FSDP", "FSDP_TP", "HYBRID", "MP", "PIPELINE", "PS", "SINGLE", "TP", "ZERO1",
           "ZERO2", "Cost", "CostModel", "PlanOptions"]


@dataclass(frozen=True, kw_only=True)
class PlanOptions:
    """The planner's per-strategy knobs (see :func:`paratrain.plan.model.plan`)."""

    num_servers: int = 1
    num_microbatches: int | None = None
    overlap: float = 1.0
    bucket_bytes: float = DEFAULT_BUCKET_BYTES


@dataclass(frozen=True, kw_only=True)
class Cost:
    """One step of one strategy, before the optimizer step (seconds, bytes)."""

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
    optimizer_divisor: int = 1
    """How many devices (or servers) share the optimizer step, in parallel."""
    shard_devices: int | None = None
    """Devices the "N" parts of the sharding are split over; None: all of ``devices``."""
    tensor_held: float = 1.0
    """Share of each "N" part a device keeps before that division: a tensor rank holds
    1/t of the split layers and all of the replicated ones (``tp_share``)."""


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """How the planner costs one strategy."""

    sharding: tuple[str, str, str]
    """How (parameters, gradients, optimizer state) spread over the devices: "N" divides
    by the number of devices, "1" keeps a full copy, "0" holds none."""

    cost: Callable[[ModelProfile, Hardware, int, PlanOptions], Cost]
    """``cost(profile, hardware, batch_size_per_device, options)``."""


def _slowest_link(hw: Hardware) -> tuple[float, float]:
    if hw.num_nodes > 1:
        return hw.inter_node_bandwidth, hw.inter_node_latency
    return hw.intra_node_bandwidth, hw.intra_node_latency


def _single(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions) -> Cost:
    return Cost(devices=1, batch=b, compute=b * pr.step_compute_time_per_sample)


def _ddp(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions) -> Cost:
    # Buckets are all-reduced while backward runs; only the last one, ready when backward
    # ends, cannot hide.
    w = hw.world_size
    buckets = ddp_buckets(pr.grad_size, pr.num_layers, o.bucket_bytes)
    comm = sum(allreduce_time(x, hw) for x in buckets)
    exposed = exposed_comm_time(comm, b * pr.backward_time_per_sample, overlap=o.overlap,
                                tail=allreduce_time(buckets[-1], hw))
    return Cost(devices=w, batch=w * b, compute=b * pr.step_compute_time_per_sample, comm=comm,
                exposed=exposed, traffic=allreduce_bytes(pr.grad_size, hw))


def _zero1(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions) -> Cost:
    # Gradients are all-reduced in buckets while backward runs, as under DDP; only the
    # last bucket cannot hide. Each rank then updates its 1/N and the new parameters are
    # all-gathered, with nothing to hide behind.
    w = hw.world_size
    buckets = ddp_buckets(pr.grad_size, pr.num_layers, o.bucket_bytes)
    comm = sum(allreduce_time(x, hw) for x in buckets)
    exposed = exposed_comm_time(comm, b * pr.backward_time_per_sample, overlap=o.overlap,
                                tail=allreduce_time(buckets[-1], hw))
    ag = allgather_time(pr.param_size, hw)
    return Cost(devices=w, batch=w * b, compute=b * pr.step_compute_time_per_sample,
                comm=comm + ag, exposed=exposed + ag,
                traffic=allreduce_bytes(pr.grad_size, hw) + allgather_bytes(pr.param_size, hw),
                optimizer_divisor=w)


def _zero2(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions) -> Cost:
    # The runtime's zero2 is fsdp with reshard_after_forward=False: a unit's parameters
    # stay whole from its forward to its backward, so backward gathers nothing.
    return _fsdp(pr, hw, b, o, regather=False)


def _fsdp(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions, *,
          regather: bool = True) -> Cost:
    # One unit per layer. Forward all-gathers hide behind forward except the first; backward
    # all-gathers (when forward resharded, ``regather``) + reduce-scatters hide behind
    # backward except the last reduce-scatter.
    w, layers = hw.world_size, pr.num_layers
    ag = allgather_time(pr.param_size / layers, hw)
    rs = reduce_scatter_time(pr.grad_size / layers, hw)
    gathers = 2 if regather else 1
    exp_f = exposed_comm_time(layers * ag, b * pr.forward_time_per_sample, overlap=o.overlap,
                              tail=ag)
    exp_b = exposed_comm_time(layers * ((ag if regather else 0.0) + rs),
                              b * pr.backward_time_per_sample, overlap=o.overlap, tail=rs)
    return Cost(devices=w, batch=w * b, compute=b * pr.step_compute_time_per_sample,
                comm=layers * (gathers * ag + rs), exposed=exp_f + exp_b,
                traffic=gathers * allgather_bytes(pr.param_size, hw)
                + allgather_bytes(pr.grad_size, hw),
                optimizer_divisor=w)


def _hybrid(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions) -> Cost:
    # The default layout (HSDP): FSDP within each node, replicas across nodes. Per layer,
    # parameters are all-gathered and gradients reduce-scattered over the node's n devices,
    # then each 1/n shard of the gradients is all-reduced over the k nodes; overlap as FSDP.
    n, k, layers = hw.num_devices_per_node, hw.num_nodes, pr.num_layers
    bi, ai, be, ae = (hw.intra_node_bandwidth, hw.intra_node_latency, hw.inter_node_bandwidth,
                      hw.inter_node_latency)
    ag = ring_allgather_time(pr.param_size / layers, n, bi, ai)
    rs = ring_reduce_scatter_time(pr.grad_size / layers, n, bi, ai)
    ar = ring_allreduce_time(pr.grad_size / layers / n, k, be, ae)
    exp_f = exposed_comm_time(layers * ag, b * pr.forward_time_per_sample, overlap=o.overlap,
                              tail=ag)
    exp_b = exposed_comm_time(layers * (ag + rs + ar), b * pr.backward_time_per_sample,
                              overlap=o.overlap, tail=rs + ar)
    traffic = ((n - 1) / n * (2 * pr.param_size + pr.grad_size)
               + 2 * (k - 1) / k * pr.grad_size / n)
    return Cost(devices=n * k, batch=n * k * b, compute=b * pr.step_compute_time_per_sample,
                comm=layers * (2 * ag + rs + ar), exposed=exp_f + exp_b, traffic=traffic,
                note=f"shard {n} x replicate {k}", optimizer_divisor=n, shard_devices=n)


def tp_share(split_fraction: float, t: int) -> float:
    """What one of ``t`` tensor ranks holds (or computes) of something of which
    ``split_fraction`` is split and the rest replicated."""
    return split_fraction / t + 1 - split_fraction


TP_TRAFFIC_UNKNOWN = ("not ranked: tensor-parallel traffic unknown (0 activation bytes per "
                      "sample); pass --activation-bytes, or --model to calibrate")


def without_tp_traffic(cost: Cost, pr: ModelProfile, t: int) -> Cost:
    """``cost``, not applicable when ``t > 1`` tensor ranks all-reduce activations of
    unknown size: neither measured (``tp_allreduces``) nor estimable from
    ``activation_bytes_per_sample`` (0, as ``paratrain plan --num-parameters`` leaves it).
    Costed at 0 bytes, tensor parallelism would look free and win on any link."""
    if t > 1 and not pr.tp_allreduces and not pr.activation_bytes_per_sample:
        return replace(cost, applicable=False, note=TP_TRAFFIC_UNKNOWN)
    return cost


def _tp_comm(pr: ModelProfile, hw: Hardware, b: int, t: int) -> tuple[float, float]:
    # On the critical path (nothing to hide behind): each rowwise layer all-reduces its
    # output forward, each colwise layer its input's gradient backward (separate q/k/v:
    # three). Measured by calibration (tp_allreduces, tp_allreduce_bytes_per_sample);
    # without them, 4 per layer of the activation bytes per layer, which counts every
    # parameterised leaf (norms, embeddings) as a layer and overestimates. Consecutive
    # ranks: inside a node while t fits.
    if pr.tp_allreduces:
        count, size = pr.tp_allreduces, b * pr.tp_allreduce_bytes_per_sample / pr.tp_allreduces
    else:
        count, size = 4 * pr.num_layers, b * pr.activation_bytes_per_sample / pr.num_layers
    bw, lat = ((hw.intra_node_bandwidth, hw.intra_node_latency) if t <= hw.num_devices_per_node
               else _slowest_link(hw))
    comm = count * ring_allreduce_time(size, t, bw, lat)
    return comm, 0.0 if t == 1 else count * 2 * (t - 1) / t * size


def _tp(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions) -> Cost:
    # Every device reads the same b samples and does 1/t of each split layer's work;
    # embeddings, norms, head and loss run whole on every rank. DTensor's dispatch is a
    # fixed cost per step on top (one process runs as single: none).
    t = hw.world_size
    comm, traffic = _tp_comm(pr, hw, b, t)
    share = tp_share(pr.tp_split_fraction, t)
    compute = b * pr.step_compute_time_per_sample * share + (pr.tp_dispatch_time if t > 1 else 0.0)
    return without_tp_traffic(Cost(
        devices=t, batch=b, compute=compute, comm=comm, exposed=comm, traffic=traffic,
        optimizer_divisor=t, shard_devices=1, tensor_held=tp_share(pr.tp_split_param_fraction, t),
        note="tp across nodes" if t > hw.num_devices_per_node else ""), pr, t)


def _fsdp_tp(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions) -> Cost:
    # The default layout: tensor degree 2 (consecutive ranks), FSDP over the s = w / 2
    # groups, each FSDP unit holding a tensor rank's part of a layer (1/2 of the split
    # parameters, all of the replicated ones); overlap as FSDP.
    w, t, layers = hw.world_size, 2, pr.num_layers
    if w % t:
        return Cost(devices=w, batch=b, compute=b * pr.step_compute_time_per_sample,
                    applicable=False, note=f"needs an even number of devices, has {w}")
    s = w // t
    tp_comm, tp_traffic = _tp_comm(pr, hw, b, t)
    bw, lat = (hw.intra_node_bandwidth, hw.intra_node_latency) if w <= hw.num_devices_per_node \
        else _slowest_link(hw)
    local = tp_share(pr.tp_split_param_fraction, t)
    ag = ring_allgather_time(pr.param_size / layers * local, s, bw, lat)
    rs = ring_reduce_scatter_time(pr.grad_size / layers * local, s, bw, lat)
    share = tp_share(pr.tp_split_fraction, t)
    exp_f = exposed_comm_time(layers * ag, b * pr.forward_time_per_sample * share,
                              overlap=o.overlap, tail=ag)
    exp_b = exposed_comm_time(layers * (ag + rs), b * pr.backward_time_per_sample * share,
                              overlap=o.overlap, tail=rs)
    fsdp_traffic = 0.0 if s == 1 else (s - 1) / s * (2 * pr.param_size + pr.grad_size) * local
    return without_tp_traffic(Cost(
        devices=w, batch=s * b,
        compute=b * pr.step_compute_time_per_sample * share + pr.tp_dispatch_time,
        comm=tp_comm + layers * (2 * ag + rs), exposed=tp_comm + exp_f + exp_b,
        traffic=tp_traffic + fsdp_traffic, note=f"shard {s} x tensor {t}",
        optimizer_divisor=w, shard_devices=s, tensor_held=local), pr, t)


def _ps(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions) -> Cost:
    w, k = hw.world_size, o.num_servers
    bw, lat = _slowest_link(hw)  # servers sit behind the inter-node link once there are nodes
    comm = ps_comm_time(pr.grad_size, pr.param_size, num_workers=w, num_servers=k,
                        bandwidth=bw, latency=lat)
    # Workers keep no optimizer state; they wait while the k servers step their shards.
    return Cost(devices=w, batch=w * b, compute=b * pr.step_compute_time_per_sample, comm=comm,
                exposed=comm, traffic=w * (pr.grad_size + pr.param_size) / k,
                note=f"+{k} server(s)", optimizer_divisor=k)


def _dp(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions) -> Cost:
    # One process drives the node's devices; parameters are copied out of device 0 and
    # gradients copied back every step, serialized on device 0's link, with no overlap.
    n, sp, sg = hw.num_devices_per_node, pr.param_size, pr.grad_size
    comm = (n - 1) * (sp + sg) / hw.intra_node_bandwidth + 2 * (n - 1) * hw.intra_node_latency
    return Cost(devices=n, batch=n * b, compute=b * pr.step_compute_time_per_sample, comm=comm,
                exposed=comm, traffic=(n - 1) * (sp + sg),
                note="one node only" if hw.num_nodes > 1 else "")


def _mp(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions) -> Cost:
    # One process, the layers spread over the node's devices, one device busy at a time:
    # the whole batch runs every layer in turn, and each device boundary (plus the output's
    # way back to device 0) is crossed forward and again backward with nothing to hide behind.
    n = hw.num_devices_per_node
    compute = b * pr.step_compute_time_per_sample
    note = "one node only" if hw.num_nodes > 1 else ""
    if n == 1:
        return Cost(devices=1, batch=b, compute=compute, note="needs 2+ devices: runs as single")
    layers = len(pr.chain) or pr.num_layers
    if layers < n:
        return Cost(devices=n, batch=b, compute=compute, applicable=False,
                    note=f"needs >= {n} layers, model has {layers}")
    if pr.chain:
        cuts = balanced_split([params for params, _ in pr.chain], n)
        crossing = [pr.chain[i - 1][1] for i in cuts] + [pr.chain[-1][1]]
    else:
        crossing = [pr.activation_bytes_per_sample / pr.num_layers] * n
    sent = b * sum(crossing)
    comm = 2 * (sent / hw.intra_node_bandwidth + n * hw.intra_node_latency)
    return Cost(devices=n, batch=b, compute=compute, comm=comm, exposed=comm,
                traffic=2 * sent, note=note)


def _microbatches(o: PlanOptions, p: int, batch: int) -> int:
    m = min(4 * p, batch) if o.num_microbatches is None else o.num_microbatches
    if m > batch:
        raise ValueError(f"num_microbatches ({m}) must not exceed the mini-batch of {batch} samples")
    return m


def _stage_split(pr: ModelProfile, p: int, micro: float) -> tuple[list[float], float]:
    """Each of ``p`` stages' share of the compute, and the bytes of one micro-batch of
    ``micro`` samples crossing the busiest stage boundary."""
    shares = [1.0 / p] * p
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
    return shares, boundary


def _pipeline_step(slots: list[float], p2p: float, m: int, overlap: float) -> float:
    """One step of ``m`` micro-batches through stages taking ``slots`` seconds each per
    micro-batch, ``p2p`` seconds per boundary transfer."""
    # The first micro-batch passes every stage and crosses every boundary forward and back
    # with nothing to hide behind (fill and drain). In the steady state a stage computes
    # the next micro-batch while its sends are in flight, and activations and gradients
    # use the two directions of the link, so each further micro-batch costs
    # max(slowest stage, one transfer) when sends overlap compute and the slowest stage
    # plus both transfers when they do not.
    slot_max, slot_sum = max(slots), sum(slots)
    hidden = max(slot_max, p2p)
    serial = slot_max + 2 * p2p
    per_micro = overlap * hidden + (1 - overlap) * serial
    return slot_sum + 2 * (len(slots) - 1) * p2p + (m - 1) * per_micro


def _pipeline(pr: ModelProfile, hw: Hardware, b: int, o: PlanOptions) -> Cost:
    # p stages = all devices; the mini-batch is b * p samples (same global batch as DDP),
    # split into m micro-batches.
    p = hw.world_size
    batch = b * p
    m = _microbatches(o, p, batch)
    layers = len(pr.chain) or pr.num_layers
    if layers < p:
        return Cost(devices=p, batch=batch, compute=b * pr.step_compute_time_per_sample,
                    applicable=False, note=f"needs >= {p} layers, model has {layers}",
                    optimizer_divisor=p)
    micro = batch / m
    shares, boundary = _stage_split(pr, p, micro)
    # One stage's forward + backward of one micro-batch. Parameters balance the cut, not
    # compute: the slowest stage sets the pace.
    stage = [micro * pr.step_compute_time_per_sample * share for share in shares]
    bw, lat = _slowest_link(hw)  # the slowest stage boundary sets the pace
    p2p = 0.0 if p == 1 else lat + boundary / bw  # activation forward or its gradient backward
    busy = sum(stage) + (m - 1) * max(stage)  # the step without transfers
    step = _pipeline_step(stage, p2p, m, o.overlap)
    compute = m * sum(stage) / p  # one device's work, on average
    return Cost(devices=p, batch=batch, compute=compute, comm=2 * m * p2p,
                exposed=max(0.0, step - busy), bubble=busy - compute,
                bubble_fraction=(busy - compute) / busy if busy > 0 else 0.0,
                traffic=0.0 if p == 1 else 2 * m * boundary, note=f"m={m}",
                optimizer_divisor=p)


SINGLE = CostModel(sharding=("1", "1", "1"), cost=_single)
DDP = CostModel(sharding=("1", "1", "1"), cost=_ddp)
ZERO1 = CostModel(sharding=("1", "1", "N"), cost=_zero1)
ZERO2 = CostModel(sharding=("1", "N", "N"), cost=_zero2)  # whole parameters from forward to backward
FSDP = CostModel(sharding=("N", "N", "N"), cost=_fsdp)
PIPELINE = CostModel(sharding=("N", "N", "N"), cost=_pipeline)  # each stage holds 1/p of the layers
# The default layout (HSDP); paratrain.plan.layouts costs the others.
HYBRID = CostModel(sharding=("N", "N", "N"), cost=_hybrid)
# Only the split layers are divided by the tensor degree; counting every parameter as
# split underestimates memory by the replicated embeddings, norms and head.
TP = CostModel(sharding=("N", "N", "N"), cost=_tp)
FSDP_TP = CostModel(sharding=("N", "N", "N"), cost=_fsdp_tp)
PS = CostModel(sharding=("1", "1", "0"), cost=_ps)  # the servers hold the optimizer state
DP = CostModel(sharding=("1", "1", "1"), cost=_dp)  # device 0 holds the master copy and the optimizer
MP = CostModel(sharding=("N", "N", "N"), cost=_mp)  # each device holds its layers
