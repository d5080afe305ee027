"""Step time and memory per rank under context parallel (cp) and expert parallel (ep).

Both are costed on top of a calibrated :class:`~paratrain.plan.types.ModelProfile` (one
sample = one sequence) and a :class:`TransformerShape` (what the profile cannot say: the
sequence length, the width, how many attention and MoE layers, the experts).

**Context parallel** (:mod:`paratrain.strategies.context`, ring attention): each of the
``cp`` ranks holds ``1/cp`` of every sequence, so its compute is ``compute / cp`` (the
load-balanced order gives every rank the same causal work). Per attention layer the
stacked K/V block of a rank (``b * s/cp * 2 * width * 4`` bytes: the ring computes and
sends in float32, after grouped-query heads are repeated) makes ``2 (cp - 1)`` hops:
``cp - 1`` forward and ``cp - 1`` again in backward, where the block's dK/dV travel
beside it and take one hop more (``cp`` gradient hops). Only the transfers not hidden
behind the attention compute add to the step (``overlap``; the runtime's ring waits for
each hop before computing, so 0 describes it today). The parameters are replicated over
the cp ranks: their gradients are all-reduced as under DDP.

**Expert parallel** (:mod:`paratrain.strategies.experts`, dropless all-to-all): each
rank reads its own ``b`` sequences and holds ``experts / ep`` experts of every MoE layer.
Per MoE layer the ``tokens * top_k`` routed rows of width ``d`` cross the all-to-all four
times (dispatch and combine, forward and backward), ``(ep - 1) / ep`` of them leaving the
rank under even routing, plus one small exchange of the counts; the next layer needs
them, so none hides. Balanced routing keeps each rank's expert work at one process's.

A blocking transfer posted right after compute can cost more than the link's latency:
on CPU the waiting process sleeps and the peer's data waits for it to be scheduled again
(milliseconds on a busy host, ~0 with NCCL on a GPU). ``wake`` is that cost per such
transfer (``benchmarks/plan_context_experts.py`` measures it as a 4-byte exchange after
a burst of compute, less one back to back): the ring posts ``2 cp - 1`` of its hops per
layer after compute (the backward dK/dV hop follows the K/V hop at once), an MoE layer 4
of its 5 exchanges, the gradient sync 1.

Memory per rank: activations grow linearly with the sequence (the ring and torch's CPU
flash kernel keep ``O(s)`` per layer) and divide by ``cp``; expert parameters, gradients
and optimizer state grow with the expert count and divide by ``ep``.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratrain.plan.comm import allreduce_time, ddp_buckets, exposed_comm_time
from paratrain.plan.memory import MemoryEstimate
from paratrain.plan.types import Hardware, ModelProfile, check_number, check_positive_int

__all__ = ["MOE_COLD_TRANSFERS", "ParallelStep", "TransformerShape", "alltoall_time",
           "context_memory", "context_memory_table", "context_step", "expert_memory",
           "expert_memory_table", "expert_step",
           "moe_alltoall_bytes", "ring_block_bytes", "ring_cold_transfers",
           "ring_grad_transfers", "ring_kv_transfers", "ring_layer_bytes", "shape_of"]

#: Bytes per element the ring sends: it computes in float32 whatever the model's dtype.
RING_BYTES = 4


@dataclass(frozen=True, kw_only=True)
class TransformerShape:
    """The transformer's shape, as cp and ep costs need it (one sample = one sequence)."""

    sequence: int
    """Tokens per sequence the profile was calibrated at."""
    width: int
    """Model width ``d`` (the query width: the K/V the ring sends, and a routed row)."""
    attention_layers: int
    moe_layers: int = 0
    experts: int = 0
    """Experts per MoE layer (all ranks together); 0: a dense model."""
    top_k: int = 1
    expert_parameters: int = 0
    """Parameters of every expert of every MoE layer (the whole model's, not a rank's)."""
    row_bytes: float = 4
    """Bytes per element of a routed row (the model's dtype)."""
    attention_fraction: float = 0.0
    """Share of the compute in the attention core (scores and weighted sum): the window
    ring transfers can hide behind."""

    def __post_init__(self) -> None:
        for name in ("sequence", "width", "attention_layers", "top_k"):
            check_positive_int(name, getattr(self, name))
        for name in ("moe_layers", "experts", "expert_parameters"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        check_number("row_bytes", self.row_bytes, positive=True)
        check_number("attention_fraction", self.attention_fraction, positive=False)
        if self.attention_fraction > 1:
            raise ValueError(f"attention_fraction must be in [0, 1], got {self.attention_fraction!r}")
        if self.moe_layers and self.top_k > self.experts:
            raise ValueError(f"top_k must be <= experts ({self.experts}), got {self.top_k!r}")


@dataclass(frozen=True, kw_only=True)
class ParallelStep:
    """One rank's step under cp or ep (seconds), and what it holds (bytes)."""

    degree: int
    compute: float
    comm: float
    exposed: float
    optimizer: float
    traffic: float
    """Bytes this rank sends per step (ring or all-to-all, plus gradient all-reduce)."""
    sync: float
    """Seconds of ``comm`` in the gradient all-reduces (the rest: ring or all-to-all)."""
    memory: MemoryEstimate

    @property
    def step_time(self) -> float:
        """Compute, the communication not hidden, and the optimizer step."""
        return self.compute + self.exposed + self.optimizer


def shape_of(model, sequence: int) -> TransformerShape:
    """The :class:`TransformerShape` of a :class:`paratrain.models.GPT` at ``sequence``
    tokens; the attention share estimated from FLOPs (causal scores ``2 s d`` per token
    and layer against ``2`` per parameter of the dense or routed weights)."""
    from paratrain.strategies.experts.apply import moe_layers

    width = model.tok_emb.embedding_dim
    layers = len(model.blocks)
    moes = moe_layers(model)
    experts = moes[0].num_experts if moes else 0
    top_k = moes[0].top_k if moes else 1
    expert_params = sum(layer.w_in.numel() + layer.w_out.numel() for layer in moes)
    dense = sum(p.numel() for p in model.parameters()) - expert_params
    dense -= model.tok_emb.weight.numel() + model.pos_emb.weight.numel()  # looked up
    per_token = 2 * dense + 2 * top_k * (expert_params // max(1, experts))
    attention = 2 * sequence * width * layers
    return TransformerShape(sequence=sequence, width=width, attention_layers=layers,
                            moe_layers=len(moes), experts=experts, top_k=top_k,
                            expert_parameters=expert_params,
                            row_bytes=model.tok_emb.weight.element_size(),
                            attention_fraction=attention / (attention + per_token))


def ring_kv_transfers(cp: int) -> int:
    """K/V block hops per attention layer and step: ``cp - 1`` forward, ``cp - 1`` backward."""
    check_positive_int("cp", cp)
    return 2 * (cp - 1)


def ring_grad_transfers(cp: int) -> int:
    """dK/dV block hops per attention layer in backward: one per ring step, the last
    carrying each block's gradient home (none at ``cp = 1``)."""
    check_positive_int("cp", cp)
    return 0 if cp == 1 else cp


def ring_cold_transfers(cp: int) -> int:
    """Ring hops per attention layer posted right after compute (each pays ``wake``):
    ``cp - 1`` forward, ``cp - 1`` K/V hops backward and the last dK/dV hop home."""
    check_positive_int("cp", cp)
    return 0 if cp == 1 else 2 * cp - 1


#: All-to-alls per MoE layer posted right after compute: the counts, the forward
#: combine and both backward exchanges (the forward dispatch follows the counts at once).
MOE_COLD_TRANSFERS = 4


def ring_block_bytes(shape: TransformerShape, cp: int, batch: int) -> float:
    """Bytes of one rank's stacked K and V block (or of its dK/dV) in one layer."""
    return batch * shape.sequence / cp * 2 * shape.width * RING_BYTES


def ring_layer_bytes(shape: TransformerShape, cp: int, batch: int) -> float:
    """Bytes one rank sends per attention layer and step round the ring."""
    return (ring_kv_transfers(cp) + ring_grad_transfers(cp)) * ring_block_bytes(shape, cp, batch)


def moe_alltoall_bytes(tokens: int, top_k: int, width: int, row_bytes: float) -> float:
    """Bytes of routed rows per MoE layer and step: ``tokens * top_k`` rows of ``width``
    elements, dispatched and combined, forward and backward (4 all-to-alls)."""
    for name, value in (("tokens", tokens), ("top_k", top_k), ("width", width)):
        check_positive_int(name, value)
    check_number("row_bytes", row_bytes, positive=True)
    return 4 * tokens * top_k * width * row_bytes


def alltoall_time(size_bytes: float, num_ranks: int, bandwidth: float, latency: float) -> float:
    """All-to-all of ``S`` bytes per rank (pairwise): ``(N-1)/N * S/B + (N-1) * alpha``."""
    n = num_ranks
    return 0.0 if n <= 1 else (n - 1) / n * size_bytes / bandwidth + (n - 1) * latency


def _link(hw: Hardware, group: int) -> tuple[float, float]:
    """Consecutive ranks: the node's link while ``group`` fits in a node."""
    if group <= hw.num_devices_per_node or hw.num_nodes == 1:
        return hw.intra_node_bandwidth, hw.intra_node_latency
    return hw.inter_node_bandwidth, hw.inter_node_latency


def _check(hw: Hardware, name: str, degree: int) -> None:
    check_positive_int(name, degree)
    if hw.world_size % degree:
        raise ValueError(f"{name}={degree} must divide the {hw.world_size} devices")


def _gradient_sync(grad_bytes: float, layers: int, window: float, hw: Hardware, replicas: int,
                   overlap: float, wake: float) -> tuple[float, float, float]:
    """(comm, exposed, bytes sent) of DDP-style bucketed all-reduces over ``replicas``,
    the first after backward's compute (``wake``)."""
    if replicas == 1 or grad_bytes == 0:
        return 0.0, 0.0, 0.0
    group = Hardware(num_devices_per_node=min(replicas, hw.num_devices_per_node),
                     num_nodes=max(1, replicas // hw.num_devices_per_node),
                     intra_node_bandwidth=hw.intra_node_bandwidth,
                     intra_node_latency=hw.intra_node_latency,
                     inter_node_bandwidth=hw.inter_node_bandwidth,
                     inter_node_latency=hw.inter_node_latency)
    buckets = ddp_buckets(grad_bytes, layers)
    comm = wake + sum(allreduce_time(x, group) for x in buckets)
    exposed = exposed_comm_time(comm, window, overlap=overlap,
                                tail=allreduce_time(buckets[-1], group))
    return comm, exposed, 2 * (replicas - 1) / replicas * grad_bytes


def context_memory(profile: ModelProfile, shape: TransformerShape, *, cp: int,
                   batch: int, sequence: int | None = None) -> MemoryEstimate:
    """One rank's memory under ``cp`` at ``sequence`` tokens (default: the calibrated
    length): the whole model state, activations scaled by ``sequence / shape.sequence``
    and divided by ``cp``."""
    check_positive_int("cp", cp)
    check_positive_int("batch", batch)
    sequence = shape.sequence if sequence is None else sequence
    check_positive_int("sequence", sequence)
    if sequence % (2 * cp):
        raise ValueError(f"sequence must be a multiple of 2 * cp = {2 * cp}, got {sequence}")
    activations = batch * profile.stored_activation_bytes_per_sample * sequence / shape.sequence
    return MemoryEstimate(param_memory=profile.param_size, grad_memory=profile.grad_size,
                          optimizer_memory=profile.optimizer_size,
                          activation_memory=activations / cp)


def context_step(profile: ModelProfile, hw: Hardware, shape: TransformerShape, *, cp: int,
                 batch: int, overlap: float = 0.0, wake: float = 0.0) -> ParallelStep:
    """One rank's step with ``cp`` ranks per sequence (consecutive ranks) and
    ``world / cp`` data-parallel replicas, ``batch`` sequences per replica.

    ``overlap``: share of the attention compute the ring transfers hide behind (0: the
    runtime's ring, which waits for each hop); the gradient all-reduce over all ranks
    hides behind backward by the same share. ``wake``: seconds a transfer posted right
    after compute costs beyond the link (see the module's docstring).
    """
    _check(hw, "cp", cp)
    check_number("overlap", overlap, positive=False)
    check_number("wake", wake, positive=False)
    compute = batch * profile.step_compute_time_per_sample / cp
    bandwidth, latency = _link(hw, cp)
    hops = ring_kv_transfers(cp) + ring_grad_transfers(cp)
    block = ring_block_bytes(shape, cp, batch)
    ring = shape.attention_layers * (hops * (latency + block / bandwidth)
                                     + ring_cold_transfers(cp) * wake)
    ring_exposed = exposed_comm_time(ring, shape.attention_fraction * compute, overlap=overlap)
    # Every rank holds every parameter: gradients are summed over all world ranks (the cp
    # ranks saw parts of the same sequences, the replicas other sequences).
    sync, sync_exposed, sync_bytes = _gradient_sync(
        profile.grad_size, profile.num_layers, batch * profile.backward_time_per_sample / cp,
        hw, hw.world_size, overlap, wake)
    return ParallelStep(degree=cp, compute=compute, comm=ring + sync, sync=sync,
                        exposed=ring_exposed + sync_exposed,
                        optimizer=profile.optimizer_step_time,
                        traffic=shape.attention_layers * ring_layer_bytes(shape, cp, batch)
                        + sync_bytes,
                        memory=context_memory(profile, shape, cp=cp, batch=batch))


def _expert_share(profile: ModelProfile, shape: TransformerShape, ep: int,
                  experts: int) -> tuple[float, float]:
    """(parameters one rank holds, expert parameters in the model) at ``experts`` per layer."""
    if shape.experts == 0:
        return float(profile.num_parameters), 0.0
    per_expert = shape.expert_parameters / shape.experts
    dense = profile.num_parameters - shape.expert_parameters
    return dense + experts * per_expert / ep, experts * per_expert


def expert_memory(profile: ModelProfile, shape: TransformerShape, *, ep: int, batch: int,
                  experts: int | None = None) -> MemoryEstimate:
    """One rank's memory under ``ep`` with ``experts`` per MoE layer (default: the
    calibrated count): the dense state whole, the experts' parameters, gradients and
    optimizer state divided by ``ep``; activations as one process's."""
    check_positive_int("ep", ep)
    check_positive_int("batch", batch)
    experts = shape.experts if experts is None else experts
    check_positive_int("experts", experts)
    if experts % ep:
        raise ValueError(f"experts must be a multiple of ep = {ep}, got {experts}")
    held, _ = _expert_share(profile, shape, ep, experts)
    return MemoryEstimate(param_memory=held * profile.param_bytes,
                          grad_memory=held * profile.grad_bytes,
                          optimizer_memory=held * profile.optimizer_bytes_per_param,
                          activation_memory=batch * profile.stored_activation_bytes_per_sample)


def expert_step(profile: ModelProfile, hw: Hardware, shape: TransformerShape, *, ep: int,
                batch: int, overlap: float = 0.0, wake: float = 0.0) -> ParallelStep:
    """One rank's step with the experts split over ``ep`` consecutive ranks and every
    rank reading ``batch`` sequences (data parallel over all ranks).

    ``overlap``: share of backward the gradient all-reduces hide behind (the all-to-alls
    never hide: the next layer waits for them). The dense gradients are summed over all
    ranks, each expert's over the ``world / ep`` ranks holding it. ``wake``: as
    :func:`context_step`'s.
    """
    _check(hw, "ep", ep)
    check_number("overlap", overlap, positive=False)
    check_number("wake", wake, positive=False)
    if shape.moe_layers == 0:
        raise ValueError("shape.moe_layers must be >= 1 for expert parallel")
    if shape.experts % ep:
        raise ValueError(f"ep={ep} must divide shape.experts={shape.experts}")
    compute = batch * profile.step_compute_time_per_sample
    bandwidth, latency = _link(hw, ep)
    rows = moe_alltoall_bytes(batch * shape.sequence, shape.top_k, shape.width, shape.row_bytes)
    # Four exchanges of rows and one of the per-expert counts per layer.
    per_layer = (4 * alltoall_time(rows / 4, ep, bandwidth, latency) + (ep - 1) * latency
                 + MOE_COLD_TRANSFERS * wake)
    a2a = shape.moe_layers * per_layer if ep > 1 else 0.0
    window = batch * profile.backward_time_per_sample
    held, expert_params = _expert_share(profile, shape, ep, shape.experts)
    dense = (profile.num_parameters - expert_params) * profile.grad_bytes
    sync, sync_exposed, sync_bytes = _gradient_sync(dense, profile.num_layers, window, hw,
                                                    hw.world_size, overlap, wake)
    esync, esync_exposed, esync_bytes = _gradient_sync(
        expert_params / ep * profile.grad_bytes, profile.num_layers, window, hw,
        hw.world_size // ep, overlap, 0.0)
    return ParallelStep(degree=ep, compute=compute, comm=a2a + sync + esync, sync=sync + esync,
                        exposed=a2a + sync_exposed + esync_exposed,
                        optimizer=profile.optimizer_step_time * held / profile.num_parameters,
                        traffic=shape.moe_layers * (ep - 1) / ep * rows + sync_bytes + esync_bytes,
                        memory=expert_memory(profile, shape, ep=ep, batch=batch))


def _table(corner: str, rows: list[int], columns: list[str], cells) -> str:
    lines = [f"{corner:>8} " + " ".join(f"{c:>10}" for c in columns)]
    lines += [f"{row:>8} " + " ".join(f"{cell / 2**20:>7.2f} MB" for cell in cells(row))
              for row in rows]
    return "\n".join(lines)


def context_memory_table(profile: ModelProfile, shape: TransformerShape, *,
                         sequences: list[int], cps: list[int], batch: int = 1) -> str:
    """Activation memory per rank (MiB): one row per sequence length, one column per cp."""
    return _table("sequence", sequences, [f"cp={c}" for c in cps], lambda s: [
        context_memory(profile, shape, cp=c, batch=batch, sequence=s).activation_memory
        for c in cps])


def expert_memory_table(profile: ModelProfile, shape: TransformerShape, *,
                        experts: list[int], eps: list[int]) -> str:
    """Parameters + gradients + optimizer state per rank (MiB): one row per expert count,
    one column per ep."""
    def state(e: int, ep: int) -> float:
        m = expert_memory(profile, shape, ep=ep, batch=1, experts=e)
        return m.total - m.activation_memory
    return _table("experts", experts, [f"ep={e}" for e in eps],
                  lambda e: [state(e, ep) for ep in eps])
