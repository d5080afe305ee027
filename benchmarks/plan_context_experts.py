"""Does ``paratrain plan`` predict context- and expert-parallel steps? Predicted vs measured.

One run of 2 gloo processes (one thread each) measures, through the model-level pieces:

* **cp=2**: the GPT of ``paratrain.models`` on one long sequence, each rank holding its
  load-balanced half (:class:`SequenceOrder`) with ring attention
  (:class:`ContextParallelAttention`), gradients summed over both ranks in one flat
  all-reduce, then Adam;
* **ep=2**: the MoE GPT, each rank reading its own sequences, the experts split over the
  two ranks (:func:`apply_expert_parallel`), dense gradients averaged in one flat
  all-reduce, then Adam.

Calibration as in ``plan_validation.py``: the sizes and backward share come from one
process's :func:`paratrain.plan.calibrate`; the compute is the job's own
communication-free phase ("in-situ": both processes share this machine's cores), i.e.
cp=2's ring with every hop replaced by the local block (the same blocks, masks and
kernels, no transfer) and ep=2's whole model on the rank's own tokens (the same rows
through the experts); the link is the job's 4 MB and 4-byte all-reduce probe; overlap
is 0 (gloo on busy CPU cores; the ring also waits for each hop). On CPU a transfer posted
right after compute costs more than that probe's back-to-back latency (gloo's I/O thread
must be scheduled again: milliseconds on a loaded host), so every iteration of each job
also samples it (a 4-byte all-reduce after 20 ms of compute, less one back to back) and
the plan's ``wake`` is that job's median; ``pred(no wake)`` leaves it out, as
``plan_validation.py`` would. ``pred(1 proc)`` uses the one-process calibration instead:
it misses that the ring's block-by-block attention is several times slower on CPU than
torch's fused kernel. The memory rows are the planner's, from the same
calibration, beside what the cp=2 and ep=2 ranks measured.

    python benchmarks/plan_context_experts.py
    python benchmarks/plan_context_experts.py --length 1024 --steps 4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from memory_probe import saved_activations

import paratrain.strategies.context.attention as ring_module
import paratrain.strategies.experts.dispatch as dispatch_module
from paratrain.distributed.spawn import spawn
from paratrain.models import GPT
from paratrain.plan import Hardware, calibrate
from paratrain.plan.comm import DEFAULT_BUCKET_BYTES, DEFAULT_FIRST_BUCKET_BYTES
from paratrain.plan.context_experts import (
    context_memory,
    context_memory_table,
    context_step,
    expert_memory,
    expert_memory_table,
    expert_step,
    shape_of,
)
from paratrain.strategies.context.routing import ContextParallelAttention
from paratrain.strategies.context.sequence import SequenceOrder
from paratrain.strategies.experts.apply import (
    apply_expert_parallel,
    average_expert_gradients,
    expert_parameters,
    moe_layers,
)
from paratrain.strategies.experts.moe import balance_loss

CP_VOCAB, EP_VOCAB, EP_LENGTH = 64, 128, 64


def cp_model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=CP_VOCAB, block_size=args.length, n_layer=2, n_head=4, n_embd=args.width)


def ep_model(args) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=EP_VOCAB, block_size=EP_LENGTH, n_layer=2, n_head=4, n_embd=args.width,
               experts=args.experts, top_k=2)


def tokens(vocab: int, batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    t = torch.randint(0, vocab, (batch, length + 1), generator=torch.Generator().manual_seed(seed))
    return t[:, :-1], t[:, 1:]


def sync_buckets(grads: list[torch.Tensor], world: int) -> None:
    """Gradients averaged as DDP buckets them (the planner's ``ddp_buckets``): last
    parameter first, a bucket closing once it holds 1 MiB (the first) or 25 MiB, each
    flattened into one all-reduce."""
    buckets, current, size = [], [], 0
    for g in reversed(grads):
        current.append(g)
        size += g.numel() * g.element_size()
        if size >= (DEFAULT_FIRST_BUCKET_BYTES if not buckets else DEFAULT_BUCKET_BYTES):
            buckets.append(current)
            current, size = [], 0
    buckets += [current] if current else []
    for bucket in buckets:
        flat = torch.cat([g.flatten() for g in bucket])
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def busy(seconds: float) -> None:
    """Compute for ``seconds`` (one thread), as a layer does between two transfers."""
    a = torch.randn(128, 128)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a


def wake_sample() -> float:
    """A 4-byte all-reduce posted right after 20 ms of compute, less one back to back."""
    t = torch.ones(1)
    dist.barrier()
    busy(0.02)
    t0 = time.perf_counter()
    dist.all_reduce(t)
    t1 = time.perf_counter()
    dist.all_reduce(t)
    return max(0.0, 2 * t1 - t0 - time.perf_counter())


def probe() -> dict:
    """The link as the job sees it: bus bandwidth (bytes/s) and latency per hop (s) from
    the fastest of 7 back-to-back all-reduces of 4 MB and 4 bytes (``plan_validation``'s
    probe)."""
    out = []
    for n in (4_000_000, 4):
        t = torch.ones(max(1, n // 4))
        dist.all_reduce(t)
        times = []
        for _ in range(7):
            t0 = time.perf_counter()
            dist.all_reduce(t)
            times.append(time.perf_counter() - t0)
        out.append(times)
    world = dist.get_world_size()
    return {"bus": 2 * (world - 1) / world * 4_000_000 / min(out[0]),
            "latency": min(out[1]) / (2 * (world - 1))}


def cp_job(rank: int, world: int, args) -> dict:
    model = cp_model(args)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    order = SequenceOrder(cp=world, length=args.length)
    inputs, targets = (order.slice(t, rank) for t in tokens(CP_VOCAB, args.batch, args.length, 1))
    positions = order.positions(rank)[None]

    def forward_backward() -> None:
        with ContextParallelAttention(dist.group.WORLD, order):
            logits = model(inputs, position_ids=positions)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()

    # Hops go through _start_shift; the time counted is the wait (the part not overlapped).
    real_start = ring_module._start_shift
    inside: list[float] = []

    def timed_start(tensor, group, hop):
        wait = real_start(tensor, group, hop)

        def timed_wait():
            t0 = time.perf_counter()
            out = wait()
            inside.append(time.perf_counter() - t0)
            return out

        return timed_wait

    compute, opt, step, hops, wakes = [], [], [], [], []
    for i in range(args.warmup + args.steps):
        wakes.append(wake_sample())
        ring_module._start_shift = lambda tensor, group, hop: (lambda: tensor)  # no transfer
        t0 = time.perf_counter()
        forward_backward()
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        t2 = time.perf_counter()
        ring_module._start_shift = timed_start
        dist.barrier()
        inside.clear()
        t3 = time.perf_counter()
        forward_backward()
        sync_buckets([p.grad for p in model.parameters()], world)
        optimizer.step()
        optimizer.zero_grad()
        t4 = time.perf_counter()
        ring_module._start_shift = real_start
        if i >= args.warmup:
            compute.append(t1 - t0)
            opt.append(t2 - t1)
            step.append(t4 - t3)
            hops.append(sum(inside))
        dist.barrier()
    with saved_activations(model.parameters()) as saved, \
            ContextParallelAttention(dist.group.WORLD, order):
        model(inputs, position_ids=positions)
    return {"compute": statistics.median(compute), "optimizer": statistics.median(opt),
            "step": statistics.median(step), "saved": saved[0],
            "comm": statistics.median(hops), "wake": statistics.median(wakes)}


def local_exchange(tensor, group, send, receive):
    """What ``_exchange`` returns, in shape: the rank's own rows, cycled (no transfer)."""
    index = torch.arange(sum(receive)) % max(1, tensor.shape[0])
    return tensor.index_select(0, index)


class TimedCollectives:
    """``torch.distributed`` for the dispatch module, its ``all_to_all_single`` (the
    per-expert counts) timed into ``log``: the compute phase takes that time out."""

    def __init__(self, log: list[float]) -> None:
        self.log = log

    def __getattr__(self, name):
        return getattr(dist, name)

    def all_to_all_single(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = dist.all_to_all_single(*args, **kwargs)
        self.log.append(time.perf_counter() - t0)
        return out


def ep_job(rank: int, world: int, args) -> dict:
    model = ep_model(args)
    apply_expert_parallel(model, dist.group.WORLD)
    experts = expert_parameters(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    inputs, targets = tokens(EP_VOCAB, args.ep_batch, EP_LENGTH, 100 + rank)
    real_exchange = dispatch_module._exchange
    inside: list[float] = []

    def timed_exchange(tensor, group, send, receive):
        t0 = time.perf_counter()
        out = real_exchange(tensor, group, send, receive)
        inside.append(time.perf_counter() - t0)
        return out

    def forward_backward() -> None:
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        (loss + 0.01 * balance_loss(model)).backward()

    compute, opt, step, remote, hops, wakes = [], [], [], [], [], []
    for i in range(args.warmup + args.steps):
        wakes.append(wake_sample())
        # The same rows through this rank's experts, without the transfers (the small
        # exchange of counts stays, as it decides how many rows arrive, but its time
        # is taken out).
        dispatch_module._exchange = local_exchange
        counting: list[float] = []
        dispatch_module.dist = TimedCollectives(counting)
        t0 = time.perf_counter()
        forward_backward()
        t1 = time.perf_counter() - sum(counting)
        dispatch_module.dist = dist
        optimizer.step()
        optimizer.zero_grad()
        t2 = time.perf_counter()
        dispatch_module._exchange = timed_exchange
        dist.barrier()
        inside.clear()
        t3 = time.perf_counter()
        forward_backward()
        sync_buckets([p.grad for p in model.parameters() if id(p) not in experts], world)
        average_expert_gradients(model, world)
        optimizer.step()
        optimizer.zero_grad()
        t4 = time.perf_counter()
        dispatch_module._exchange = real_exchange
        if i >= args.warmup:
            compute.append(t1 - t0)
            opt.append(t2 - t1)
            step.append(t4 - t3)
            hops.append(sum(inside))
        counts = [layer.tokens_per_expert for layer in moe_layers(model)]
        half = args.experts // world
        remote.append(sum(float(c.sum() - c[rank * half:(rank + 1) * half].sum()) for c in counts)
                      / sum(float(c.sum()) for c in counts))
        dist.barrier()
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"compute": statistics.median(compute), "optimizer": statistics.median(opt),
            "step": statistics.median(step), "held": held, "remote": statistics.mean(remote),
            "comm": statistics.median(hops), "wake": statistics.median(wakes)}


def worker(rank: int, world: int, args) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return {**probe(), "cp": cp_job(rank, world, args),
            "ep": ep_job(rank, world, args)}


def calibrated(model, inputs, targets, extra=None):
    def loss(logits):
        value = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return value + 0.01 * balance_loss(model) if extra else value
    return calibrate(model, inputs, loss, repeats=5, device="cpu", optimizer="adam")


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=2048, help="cp: tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="cp: sequences per step")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--ep-batch", type=int, default=8, help="ep: sequences per rank per step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--tolerance", type=float, default=0.20)
    args = p.parse_args(argv)
    world = 2
    torch.set_num_threads(1)  # as each job's processes
    cpm, epm = cp_model(args), ep_model(args)
    base_cp = calibrated(cpm, *tokens(CP_VOCAB, args.batch, args.length, 1))
    base_ep = calibrated(epm, *tokens(EP_VOCAB, args.ep_batch, EP_LENGTH, 100), extra=True)
    cp_shape, ep_shape = shape_of(cpm, args.length), shape_of(epm, EP_LENGTH)
    ranks = spawn(worker, world, args, timeout=1200)
    bus = min(r["bus"] for r in ranks)
    latency = max(r["latency"] for r in ranks)
    hw = Hardware(num_devices_per_node=world, intra_node_bandwidth=bus, intra_node_latency=latency)
    wakes = {key: statistics.median(r[key]["wake"] for r in ranks) for key in ("cp", "ep")}
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; link probe: "
          f"{bus * 8 / 1e6:,.0f} Mbit/s bus bandwidth, {latency * 1e6:.0f} us per hop; wake-up "
          f"after compute {wakes['cp'] * 1e3:.2f} ms (cp job), {wakes['ep'] * 1e3:.2f} ms (ep job);"
          f" cp GPT 2x{args.width}, {args.batch} x {args.length} tokens; ep MoE GPT 2x{args.width},"
          f" {args.experts} experts top-2, {args.ep_batch} x {EP_LENGTH} tokens per rank")
    rows = []
    for name, key, base, shape, step_fn, batch in (
            ("cp=2 ring", "cp", base_cp, cp_shape, context_step, args.batch),
            ("ep=2 all-to-all", "ep", base_ep, ep_shape, expert_step, args.ep_batch)):
        job = [r[key] for r in ranks]
        compute = max(j["compute"] for j in job)
        scale = world if key == "cp" else 1  # cp's rank computes 1/cp of the whole model
        optimizer = max(j["optimizer"] for j in job)
        if key == "ep":  # the rank stepped its own parameters; the profile's is the model's
            optimizer *= base.num_parameters * base.param_bytes / max(j["held"] for j in job)
        situ = replace(base, compute_time_per_sample=scale * compute / batch,
                       optimizer_step_time=optimizer)
        degree = {"cp": world} if key == "cp" else {"ep": world}
        wake = wakes[key]
        pred = step_fn(situ, hw, shape, batch=batch, overlap=0.0, wake=wake, **degree)
        hot = step_fn(situ, hw, shape, batch=batch, overlap=0.0, **degree)
        one = step_fn(base, hw, shape, batch=batch, overlap=0.0, wake=wake, **degree)
        measured = max(j["step"] for j in job)
        inside = max(j["comm"] for j in job)
        rows.append((name, ms(compute), ms(pred.exposed), ms(pred.comm - pred.sync), ms(inside),
                     ms(pred.optimizer), ms(measured),
                     ms(pred.step_time), f"{pred.step_time / measured:.2f}",
                     f"{ms(hot.step_time)} ({hot.step_time / measured:.2f})",
                     ms(one.step_time), f"{pred.traffic / 1e6:.1f} MB"))
    head = ("job", "compute", "exposed comm", "ring/a2a", "in transfers", "optimizer",
            "measured", "predicted", "ratio", "pred(no wake)", "pred(1 proc)", "sent/rank")
    table = [head, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    print()
    for i, r in enumerate(table):
        print("  ".join(c.ljust(w) if j == 0 else c.rjust(w)
                        for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    cp_saved = max(r["cp"]["saved"] for r in ranks)
    ep_held = max(r["ep"]["held"] for r in ranks)
    remote = statistics.mean(r["ep"]["remote"] for r in ranks)
    print(f"\nep=2 routed rows sent to the other rank: {remote:.1%} (model: 50%)")
    print(f"\nactivation memory per rank (cp GPT, batch {args.batch}; planner, from the "
          f"one-process calibration at {args.length}):")
    print(context_memory_table(base_cp, cp_shape, sequences=[1024, 2048, 4096], cps=[1, 2, 4],
                               batch=args.batch))
    predicted = context_memory(base_cp, cp_shape, cp=world, batch=args.batch).activation_memory
    print(f"  measured at cp=2, {args.length}: {cp_saved / 2**20:.2f} MB saved for backward "
          f"(predicted {predicted / 2**20:.2f} MB, ratio {predicted / cp_saved:.2f})")
    print("\nparameters + gradients + Adam state per rank (MoE GPT; planner):")
    print(expert_memory_table(base_ep, ep_shape, experts=[4, 8, 16], eps=[1, 2, 4]))
    predicted = expert_memory(base_ep, ep_shape, ep=world, batch=args.ep_batch).param_memory
    print(f"  measured at ep=2, {args.experts} experts: {ep_held / 2**20:.2f} MB of parameters "
          f"(predicted {predicted / 2**20:.2f} MB)")
    within = sum(abs(float(r[8]) - 1) <= args.tolerance for r in rows)
    print(f"\n{within}/{len(rows)} predictions within {args.tolerance:.0%} of the measured step")
    return 0 if within == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
