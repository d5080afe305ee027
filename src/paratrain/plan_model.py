"""Closed-form performance and memory model behind ``paratrain plan``.

Pure arithmetic: no torch, no processes. Communication uses the alpha-beta
model (time = latency term + bytes / bandwidth); compute comes from a
:class:`ModelProfile` (usually measured by :func:`paratrain.plan.calibrate`).
Every formula is written out in ``docs/plan.md``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

#: Strategies in the order they are reported.
STRATEGIES: tuple[str, ...] = ("single", "ddp", "ps", "fsdp", "zero1", "zero2", "pipeline", "dp")
#: PyTorch DDP's default bucket size (``bucket_cap_mb=25``).
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
#: ... and the smaller first bucket it uses so communication starts early.
DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024
#: Predictions closer than this (relative) are a tie; the simpler strategy is recommended.
TIE_MARGIN = 0.02
#: Simplest first: the tie-break order of the recommendation.
PREFERENCE: tuple[str, ...] = ("single", "ddp", "zero1", "zero2", "fsdp", "pipeline", "ps", "dp")


def _positive_int(name: str, value: Any) -> None:
    # bool is an int subclass; True would silently mean 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _number(name: str, value: Any, *, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        kind = "a positive" if positive else "a non-negative"
        raise ValueError(f"{name} must be {kind} finite number, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Hardware:
    """The cluster: bandwidths in bytes/s, latencies in seconds, memory in bytes."""

    intra_node_bandwidth: float = 1.25e9  # 10 Gbit/s
    inter_node_bandwidth: float = 1.25e9
    intra_node_latency: float = 50e-6
    inter_node_latency: float = 50e-6
    device_memory_bytes: int | None = None  # None: memory is reported but not checked
    num_devices_per_node: int = 1
    num_nodes: int = 1

    def __post_init__(self) -> None:
        for name in ("intra_node_bandwidth", "inter_node_bandwidth"):
            _number(name, getattr(self, name), positive=True)
        for name in ("intra_node_latency", "inter_node_latency"):
            _number(name, getattr(self, name), positive=False)
        if self.device_memory_bytes is not None:
            _number("device_memory_bytes", self.device_memory_bytes, positive=True)
        _positive_int("num_devices_per_node", self.num_devices_per_node)
        _positive_int("num_nodes", self.num_nodes)

    @property
    def world_size(self) -> int:
        """Total number of devices."""
        return self.num_devices_per_node * self.num_nodes


@dataclass(frozen=True, kw_only=True)
class ModelProfile:
    """What the planner needs to know about one model (sizes in bytes, times in seconds)."""

    num_parameters: int
    param_bytes: float = 4
    grad_bytes: float = 4
    optimizer_bytes_per_param: float = 8  # Adam: two fp32 moments
    activation_bytes_per_sample: float
    compute_time_per_sample: float  # forward + backward on one device
    backward_fraction: float = 2 / 3
    num_layers: int = 1
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        _positive_int("num_parameters", self.num_parameters)
        for name in ("param_bytes", "grad_bytes", "compute_time_per_sample"):
            _number(name, getattr(self, name), positive=True)
        for name in ("optimizer_bytes_per_param", "activation_bytes_per_sample"):
            _number(name, getattr(self, name), positive=False)
        _number("backward_fraction", self.backward_fraction, positive=False)
        if self.backward_fraction > 1:
            raise ValueError(f"backward_fraction must be in [0, 1], got {self.backward_fraction!r}")
        _positive_int("num_layers", self.num_layers)
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(
                f"activation_checkpointing must be a bool, got {self.activation_checkpointing!r}"
            )

    @property
    def param_size(self) -> float:
        """Bytes of all parameters."""
        return self.num_parameters * self.param_bytes

    @property
    def grad_size(self) -> float:
        """Bytes of all gradients."""
        return self.num_parameters * self.grad_bytes

    @property
    def optimizer_size(self) -> float:
        """Bytes of the optimizer state."""
        return self.num_parameters * self.optimizer_bytes_per_param

    @property
    def stored_activation_bytes_per_sample(self) -> float:
        """Activation bytes kept for backward, per sample.

        With checkpointing only layer-boundary inputs stay alive plus one layer's
        recomputed activations during its backward: about 2 / num_layers of the total.
        """
        if not self.activation_checkpointing:
            return self.activation_bytes_per_sample
        return min(1.0, 2 / self.num_layers) * self.activation_bytes_per_sample

    @property
    def forward_time_per_sample(self) -> float:
        """Seconds of forward per sample."""
        return self.compute_time_per_sample * (1 - self.backward_fraction)

    @property
    def backward_time_per_sample(self) -> float:
        """Seconds of backward per sample; checkpointing re-runs the forward inside it."""
        extra = self.forward_time_per_sample if self.activation_checkpointing else 0.0
        return self.compute_time_per_sample * self.backward_fraction + extra

    @property
    def step_compute_time_per_sample(self) -> float:
        """Forward + backward (+ recomputation) per sample."""
        return self.forward_time_per_sample + self.backward_time_per_sample


# --- alpha-beta collectives -------------------------------------------------


def ring_allreduce_time(size_bytes: float, num_ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-reduce: ``2(N-1)/N * S/B + 2(N-1) * alpha`` (0 for one rank)."""
    n = num_ranks
    return 0.0 if n <= 1 else 2 * (n - 1) / n * size_bytes / bandwidth + 2 * (n - 1) * latency


def ring_allgather_time(size_bytes: float, num_ranks: int, bandwidth: float, latency: float) -> float:
    """Ring all-gather of a result of ``S`` bytes: ``(N-1)/N * S/B + (N-1) * alpha``."""
    n = num_ranks
    return 0.0 if n <= 1 else (n - 1) / n * size_bytes / bandwidth + (n - 1) * latency


def ring_reduce_scatter_time(
    size_bytes: float, num_ranks: int, bandwidth: float, latency: float
) -> float:
    """Ring reduce-scatter of an ``S``-byte input: same cost as the all-gather."""
    return ring_allgather_time(size_bytes, num_ranks, bandwidth, latency)


def _links(hw: Hardware) -> tuple[int, int, float, float, float, float]:
    return (hw.num_devices_per_node, hw.num_nodes, hw.intra_node_bandwidth,
            hw.intra_node_latency, hw.inter_node_bandwidth, hw.inter_node_latency)


def allreduce_time(size_bytes: float, hw: Hardware) -> float:
    """Hierarchical all-reduce: intra reduce-scatter, inter all-reduce of S/n, intra all-gather.

    With one node the inter-node term is 0 and this is exactly the ring formula.
    """
    n, k, bi, ai, be, ae = _links(hw)
    return (ring_reduce_scatter_time(size_bytes, n, bi, ai)
            + ring_allreduce_time(size_bytes / n, k, be, ae)
            + ring_allgather_time(size_bytes, n, bi, ai))


def allgather_time(size_bytes: float, hw: Hardware) -> float:
    """Hierarchical all-gather: inter-node all-gather of S/n, then intra-node of S."""
    n, k, bi, ai, be, ae = _links(hw)
    return ring_allgather_time(size_bytes / n, k, be, ae) + ring_allgather_time(size_bytes, n, bi, ai)


def reduce_scatter_time(size_bytes: float, hw: Hardware) -> float:
    """Hierarchical reduce-scatter: intra-node of S, then inter-node of S/n (mirror of all-gather)."""
    return allgather_time(size_bytes, hw)


def allreduce_bytes(size_bytes: float, hw: Hardware) -> float:
    """Bytes each device sends in :func:`allreduce_time`."""
    n, k = hw.num_devices_per_node, hw.num_nodes
    return 2 * (n - 1) / n * size_bytes + 2 * (k - 1) / k * size_bytes / n


def allgather_bytes(size_bytes: float, hw: Hardware) -> float:
    """Bytes each device sends in :func:`allgather_time` (or a reduce-scatter)."""
    n, k = hw.num_devices_per_node, hw.num_nodes
    return (n - 1) / n * size_bytes + (k - 1) / k * size_bytes / n


def ps_comm_time(
    push_bytes: float, pull_bytes: float, *, num_workers: int, num_servers: int,
    bandwidth: float, latency: float,
) -> float:
    """Synchronous parameter server, the servers' links being the bottleneck.

    Each of ``k`` servers owns 1/k of the model and, per step, receives ``W`` gradient
    shards and sends ``W`` parameter shards: ``W * (push + pull) / (k * B) + 2 * alpha``.
    """
    return num_workers * (push_bytes + pull_bytes) / (num_servers * bandwidth) + 2 * latency


def exposed_comm_time(comm: float, window: float, *, overlap: float = 1.0, tail: float = 0.0) -> float:
    """Communication left on the critical path after hiding it behind ``window`` of compute.

    ``tail`` is the part that cannot overlap (e.g. DDP's last bucket, ready only when
    backward ends); the rest hides behind ``overlap * window``.
    """
    tail = min(tail, comm)
    return tail + max(0.0, comm - tail - overlap * window)


# --- predictions --------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted cost of one strategy for one step (times in s, memory in bytes per device)."""

    strategy: str
    num_devices: int
    global_batch_size: int
    step_time: float
    compute_time: float
    comm_time: float  # all communication, as if nothing overlapped
    exposed_comm_time: float  # the part that adds to step_time
    bubble_time: float
    bubble_fraction: float
    traffic_bytes: float  # per step: bytes a device sends (ps: bytes a server moves)
    samples_per_second: float
    scaling_efficiency: float
    param_memory: float
    grad_memory: float
    optimizer_memory: float
    activation_memory: float
    memory_bytes: float
    fits: bool | None  # None when the device memory is unknown
    applicable: bool = True
    note: str = ""


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
    shard: tuple[int, int, int] = (1, 1, 1)  # divisors of params, grads, optimizer state
    applicable: bool = True
    note: str = ""


def ddp_buckets(grad_bytes: float, num_layers: int, bucket_bytes: float = DEFAULT_BUCKET_BYTES,
                first_bucket_bytes: float = DEFAULT_FIRST_BUCKET_BYTES) -> list[float]:
    """Sizes of DDP's gradient buckets, in the order backward fills them.

    Gradients arrive in equal chunks (one per layer, split further so no chunk exceeds a
    bucket), last layer first; as in DDP a bucket closes once it holds at least its cap,
    1 MiB for the first bucket and ``bucket_bytes`` for the others.
    """
    chunks = num_layers * math.ceil(grad_bytes / num_layers / bucket_bytes)
    c = grad_bytes / chunks
    first = min(chunks, math.ceil(first_bucket_bytes / c))
    per = math.ceil(bucket_bytes / c)
    full, rest = divmod(chunks - first, per)
    return [first * c] + [per * c] * full + ([rest * c] if rest else [])


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
                     traffic=traffic + allgather_bytes(sp, hw),
                     shard=(1, 1, w) if name == "zero1" else (1, w, w))
    if name == "fsdp":
        # One unit per layer. Forward all-gathers hide behind forward except the first; backward
        # all-gathers + reduce-scatters hide behind backward except the last reduce-scatter.
        ag, rs = allgather_time(sp / layers, hw), reduce_scatter_time(sg / layers, hw)
        exp_f = exposed_comm_time(layers * ag, fwd, overlap=ov, tail=ag)
        exp_b = exposed_comm_time(layers * (ag + rs), bwd, overlap=ov, tail=rs)
        return _Cost(**dp_kw, comm=layers * (2 * ag + rs), exposed=exp_f + exp_b,
                     traffic=2 * allgather_bytes(sp, hw) + allgather_bytes(sg, hw), shard=(w, w, w))
    if name == "ps":
        bw, lat = _slowest_link(hw)  # servers sit behind the inter-node link once there are nodes
        k = opts["num_servers"]
        comm = ps_comm_time(sg, sp, num_workers=w, num_servers=k, bandwidth=bw, latency=lat)
        # Workers keep no optimizer state: the servers apply the update.
        return _Cost(**dp_kw, comm=comm, exposed=comm, traffic=w * (sg + sp) / k,
                     shard=(1, 1, 0), note=f"+{k} server(s)")
    if name == "pipeline":
        return _pipeline_cost(pr, hw, b, opts["num_microbatches"])
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


def _pipeline_cost(pr: ModelProfile, hw: Hardware, b: int, m_opt: int | None) -> _Cost:
    # p stages = all devices; the mini-batch is b * p samples (same global batch as DDP),
    # split into m micro-batches and scheduled GPipe-style.
    p = hw.world_size
    batch = b * p
    m = min(4 * p, batch) if m_opt is None else m_opt
    if m > batch:
        raise ValueError(f"num_microbatches ({m}) must not exceed the mini-batch of {batch} samples")
    if pr.num_layers < p:
        return _Cost(devices=p, batch=batch, compute=b * pr.step_compute_time_per_sample,
                     applicable=False, shard=(p, p, p),
                     note=f"needs >= {p} layers, model has {pr.num_layers}")
    micro = batch / m
    slot = micro * pr.step_compute_time_per_sample / p  # one stage, one micro-batch, fwd + bwd
    boundary = micro * pr.activation_bytes_per_sample / pr.num_layers
    bw, lat = _slowest_link(hw)  # the slowest stage boundary sets the pace
    p2p = 0.0 if p == 1 else lat + boundary / bw  # activation forward or its gradient backward
    slots = m + p - 1
    comm = slots * 2 * p2p
    return _Cost(devices=p, batch=batch, compute=m * slot, comm=comm, exposed=comm,
                 bubble=(p - 1) * slot, bubble_fraction=(p - 1) / slots,
                 traffic=0.0 if p == 1 else 2 * m * boundary, shard=(p, p, p), note=f"m={m}")


def predict(
    strategy: str, profile: ModelProfile, hardware: Hardware, *, batch_size_per_device: int,
    num_servers: int = 1, num_microbatches: int | None = None, overlap: float = 1.0,
    bucket_bytes: float = DEFAULT_BUCKET_BYTES,
) -> Prediction:
    """Predict one strategy; see :func:`plan` for the arguments."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategies: unknown strategy {strategy!r} (known: {', '.join(STRATEGIES)})")
    _positive_int("batch_size_per_device", batch_size_per_device)
    _positive_int("num_servers", num_servers)
    if num_microbatches is not None:
        _positive_int("num_microbatches", num_microbatches)
    _number("overlap", overlap, positive=False)
    if overlap > 1:
        raise ValueError(f"overlap must be in [0, 1], got {overlap!r}")
    _number("bucket_bytes", bucket_bytes, positive=True)
    opts = {"num_servers": num_servers, "num_microbatches": num_microbatches,
            "overlap": overlap, "bucket_bytes": bucket_bytes}
    b = batch_size_per_device
    c = _cost(strategy, profile, hardware, b, opts)
    step = c.compute + c.exposed + c.bubble
    sps = c.batch / step
    # Reference: one device running the same per-device batch (profile already includes recompute).
    single_sps = 1.0 / profile.step_compute_time_per_sample
    sizes = (profile.param_size, profile.grad_size, profile.optimizer_size)
    pm, gm, om = (0.0 if d == 0 else size / d for size, d in zip(sizes, c.shard, strict=True))
    am = b * profile.stored_activation_bytes_per_sample
    mem = pm + gm + om + am
    limit = hardware.device_memory_bytes
    return Prediction(
        strategy=strategy, num_devices=c.devices, global_batch_size=c.batch, step_time=step,
        compute_time=c.compute, comm_time=c.comm, exposed_comm_time=c.exposed,
        bubble_time=c.bubble, bubble_fraction=c.bubble_fraction, traffic_bytes=c.traffic,
        samples_per_second=sps, scaling_efficiency=sps / (c.devices * single_sps),
        param_memory=pm, grad_memory=gm, optimizer_memory=om, activation_memory=am,
        memory_bytes=mem, fits=None if limit is None else mem <= limit,
        applicable=c.applicable, note=c.note,
    )


# --- report -------------------------------------------------------------------


def format_bytes(n: float) -> str:
    """Decimal units, as in "16GB": ``format_bytes(1.6e10) == "16 GB"``."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def format_seconds(s: float) -> str:
    """``0.0123 -> "12.3 ms"``."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.3g} {unit}"
    return f"{s * 1e9:.3g} ns" if s > 0 else "0"


@dataclass(frozen=True, kw_only=True)
class PlanReport:
    """All predictions plus the recommended strategy and a one-sentence reason."""

    profile: ModelProfile
    hardware: Hardware
    batch_size_per_device: int
    settings: dict[str, Any]
    predictions: list[Prediction] = field(default_factory=list)
    recommendation: str = ""
    reason: str = ""

    def prediction(self, strategy: str) -> Prediction:
        """The row for ``strategy`` (KeyError if it was not predicted)."""
        for p in self.predictions:
            if p.strategy == strategy:
                return p
        raise KeyError(strategy)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (only str, int, float, bool, None, lists and dicts)."""
        return {
            "profile": asdict(self.profile), "hardware": asdict(self.hardware),
            "batch_size_per_device": self.batch_size_per_device, "settings": dict(self.settings),
            "predictions": [asdict(p) for p in self.predictions],
            "recommendation": self.recommendation, "reason": self.reason,
        }

    def format_table(self) -> str:
        """An aligned plain-text table, one row per strategy."""
        head = ("strategy", "devices", "step", "samples/s", "efficiency", "exposed comm",
                "memory/device", "fits", "note")
        rows = [head]
        for p in self.predictions:
            fits = "?" if p.fits is None else ("yes" if p.fits else "NO")
            rows.append((p.strategy + ("" if p.applicable else " (n/a)"), str(p.num_devices),
                         format_seconds(p.step_time), f"{p.samples_per_second:,.1f}",
                         f"{p.scaling_efficiency:.0%}", format_seconds(p.exposed_comm_time),
                         format_bytes(p.memory_bytes), fits, p.note))
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        # Text columns left-aligned, numbers right-aligned so digits line up.
        left = {0, 7, 8}
        lines = ["  ".join(c.ljust(w) if i in left else c.rjust(w)
                           for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                 for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def _recommend(preds: list[Prediction], limit: float | None) -> tuple[str, str]:
    usable = [p for p in preds if p.applicable]
    if not usable:
        return "", "No requested strategy is applicable to this model and hardware."
    rank = {name: i for i, name in enumerate(PREFERENCE)}
    if limit is not None and not any(p.fits for p in usable):
        best = min(usable, key=lambda p: (p.memory_bytes, rank[p.strategy]))
        return best.strategy, (
            f"No strategy fits in {format_bytes(limit)} per device; {best.strategy} needs the "
            f"least ({format_bytes(best.memory_bytes)}), so lower the batch size, enable "
            "activation checkpointing or add devices.")
    cands = [p for p in usable if limit is None or p.fits]
    top = max(cands, key=lambda p: p.samples_per_second)
    # The model is not accurate to 2%: among near-ties the simplest strategy wins.
    tied = [p for p in cands if p.samples_per_second >= top.samples_per_second * (1 - TIE_MARGIN)]
    best = min(tied, key=lambda p: rank[p.strategy])
    speed = f"{best.samples_per_second:,.1f} samples/s"
    if best is not top:
        speed += (f"; {top.strategy} is predicted {top.samples_per_second / best.samples_per_second - 1:.1%}"
                  f" faster, within the {TIE_MARGIN:.0%} margin, so the simpler one wins")
    if limit is None:
        return best.strategy, (f"{best.strategy} has the highest predicted throughput ({speed}); "
                               "memory was not checked because no device memory was given.")
    slower = [p.strategy for p in usable if not p.fits
              and p.samples_per_second > best.samples_per_second]
    extra = f", while faster {', '.join(slower)} would not fit" if slower else ""
    return best.strategy, (f"{best.strategy} is the fastest strategy that fits in "
                           f"{format_bytes(limit)} per device ({speed}){extra}.")


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
    preds = [predict(s, profile, hardware, batch_size_per_device=batch_size_per_device,
                     num_servers=num_servers, num_microbatches=num_microbatches,
                     overlap=overlap, bucket_bytes=bucket_bytes) for s in names]
    rec, reason = _recommend(preds, hardware.device_memory_bytes)
    settings = {"strategies": names, "num_servers": num_servers,
                "num_microbatches": num_microbatches, "overlap": overlap,
                "bucket_bytes": bucket_bytes}
    return PlanReport(profile=profile, hardware=hardware,
                      batch_size_per_device=batch_size_per_device, settings=settings,
                      predictions=preds, recommendation=rec, reason=reason)
