"""The pipeline bubble: computed per schedule, and the idle share measured on 2 ranks.

First a table of the bubble each schedule leaves, computed from torch's own plan of
its actions (``paratrain.strategies.pipeline.bubble``: equal costs for a forward, the
backward for the input and the backward for the weights) for a few ``(p, m)``; then
the measurement below (``--computed-only`` stops after the table).

A 2-stage ``pipeline`` (gloo, one CPU thread per stage process) trains a stack of
``Linear(width, width)`` blocks under ``--schedule`` (GPipe by default) at several
micro-batch counts ``m``. For each stage it reports

* ``T``: the step time (forward + backward of the whole batch through the schedule);
* ``C``: the stage's own compute for the same step, timed alone (forward + backward of
  its ``m`` micro-batches, no schedule, no communication, the other stage waiting);
* ``C2``: the same while the other stage computes too, as in the pipeline's steady
  state: on a machine whose cores slow each other down (shared caches, memory
  bandwidth, hyper-threads) ``C2 > C``, and the step stretches by as much;
* ``idle = 1 - C / T`` (worst stage), the number the computed bubble ``b`` predicts
  when each micro-batch costs only its compute (GPipe and 1F1B: ``(p - 1) / (m + p - 1)``);
* ``o = (T (1 - b) - C) / m``: the time each micro-batch takes beyond its compute
  (send/receive, the schedule's bookkeeping); for GPipe ``T / (m + p - 1) - C / m``,
  the cost of a schedule slot. With ``o = 0`` ``idle`` is ``b``;
* ``p2p``: one blocking gloo send/receive of a micro-batch's activations between the
  two stages (a stage sends or receives one forward and one backward per micro-batch).

Two batch sizes separate the causes: if ``o`` stays roughly constant while ``C / m``
grows with the batch, the gap to the formula is per-micro-batch overhead, and it shrinks
as micro-batches get larger.

    python benchmarks/pipeline_bubble.py                                # both sizes
    python benchmarks/pipeline_bubble.py --batch-sizes 64 --microbatches 1,4 --steps 3
    python benchmarks/pipeline_bubble.py --computed-only
    python benchmarks/pipeline_bubble.py --schedule zbv --microbatches 4,8
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from memory_probe import mlp

import paratrain
from paratrain.distributed.spawn import spawn
from paratrain.parallel.options import SCHEDULES
from paratrain.strategies.pipeline.bubble import bubble_fraction
from paratrain.strategies.pipeline.schedules import microbatch_refusal

NUM_STAGES = 2
COMPUTED = ((2, 4), (2, 8), (4, 8), (4, 16), (8, 16), (8, 32))
"""(p, m) of the computed table."""


def computed_table() -> None:
    """The bubble of every schedule for :data:`COMPUTED`, from torch's plans."""
    # torch warns when its interleaved zero-bubble plan needs idle slots (few micro-batches).
    logging.getLogger("torch.distributed.pipelining.schedules").setLevel(logging.ERROR)
    print("computed bubble (idle share of p ranks; F = I = W = 1, a whole backward 2; "
          "2 stages per rank where several)")
    print(f"{'schedule':>24} " + " ".join(f"{f'p={p} m={m}':>10}" for p, m in COMPUTED))
    for schedule in SCHEDULES:
        cells = [f"{bubble_fraction(schedule, p, m):>10.3f}"
                 if microbatch_refusal(schedule, m, p) is None else f"{'-':>10}"
                 for p, m in COMPUTED]
        print(f"{schedule:>24} " + " ".join(cells))
    print(f"{'(p-1)/(m+p-1)':>24} " + " ".join(f"{(p - 1) / (m + p - 1):>10.3f}"
                                               for p, m in COMPUTED))


def bubble_worker(rank, world_size, width, depth, batch_size, num_microbatches, num_steps,
                  schedule="gpipe"):
    torch.set_num_threads(1)
    run = paratrain.Run(strategy="pipeline", progress=False, accelerator="cpu", seed=0,
                        strategy_options={"schedule": schedule,
                                          "num_microbatches": num_microbatches})
    model = mlp(width, depth)
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    x, y = torch.randn(batch_size, width), torch.randint(0, 10, (batch_size,))
    stage = model.stage_module  # all of this rank's stages, run one after the other
    micro = torch.randn(batch_size // num_microbatches, width, requires_grad=True)

    def compute() -> float:
        start = time.perf_counter()
        for _ in range(num_microbatches):
            stage(micro).sum().backward()
        return time.perf_counter() - start

    # Each repetition times a pipeline step, then this stage's compute alone (the other
    # stage waits in a barrier) and with both stages computing at once: the three
    # timings are taken back to back, under the same machine load.
    steps, alone, together = [], [], []
    for _ in range(num_steps + 1):
        run.strategy.barrier()
        start = time.perf_counter()
        run.backward(F.cross_entropy(model(x), y))
        run.strategy.barrier()
        steps.append(time.perf_counter() - start)
        optimizer.zero_grad(set_to_none=True)
        for turn in range(world_size):
            run.strategy.barrier()
            if rank == turn:
                alone.append(compute())
        run.strategy.barrier()
        together.append(compute())
    # One micro-batch's activations from stage 0 to stage 1 and back, as the schedule
    # moves them (blocking gloo point-to-point); half a round trip is one transfer.
    activation = torch.randn(batch_size // num_microbatches, width)
    round_trips = []
    for _ in range(max(num_steps, 5)):
        run.strategy.barrier()
        start = time.perf_counter()
        if rank == 0:
            dist.send(activation, 1)
            dist.recv(activation, 1)
        else:
            dist.recv(activation, 0)
            dist.send(activation, 0)
        round_trips.append(time.perf_counter() - start)
    run.strategy.barrier()
    run.close()
    # The first repetition also infers the stages' shapes.
    return {"step": statistics.median(steps[1:]), "compute": statistics.median(alone[1:]),
            "together": statistics.median(together[1:]),
            "p2p": statistics.median(round_trips) / 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--batch-sizes", default="64,1024", help="whole batch per step")
    parser.add_argument("--microbatches", default="1,2,4,8")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--schedule", default="gpipe", choices=SCHEDULES,
                        help="the schedule measured")
    parser.add_argument("--computed-only", action="store_true",
                        help="print the computed table only")
    args = parser.parse_args()
    computed_table()
    if args.computed_only:
        return
    p, schedule = NUM_STAGES, args.schedule
    print(f"\nmodel: {args.depth} x Linear({args.width}, {args.width}) + head, float32; "
          f"{p} ranks, {schedule}, gloo CPU, 1 thread per stage")
    print(f"{'batch':>6} {'m':>3} {'T ms':>8} {'C ms':>8} {'C2 ms':>8} {'C/m ms':>8} "
          f"{'o ms':>7} {'p2p ms':>7} {'idle':>6} {'idle C2':>8} {'computed':>9}")
    for batch_size in [int(b) for b in args.batch_sizes.split(",") if b]:
        for m in [int(s) for s in args.microbatches.split(",") if s]:
            if batch_size % m or microbatch_refusal(schedule, m, p):
                print(f"{batch_size:>6} {m:>3}  (skipped: {schedule} cannot run m={m} here)")
                continue
            results = spawn(bubble_worker, p, args.width, args.depth, batch_size, m,
                            args.steps, schedule, timeout=900)
            # The worst stage: the one that idles most.
            worst = max(results, key=lambda r: 1 - r["compute"] / r["step"])
            step, compute = worst["step"], worst["compute"]
            bubble = bubble_fraction(schedule, p, m)
            overhead = (step * (1 - bubble) - compute) / m
            together = worst["together"]
            print(f"{batch_size:>6} {m:>3} {step * 1e3:>8.1f} {compute * 1e3:>8.1f} "
                  f"{together * 1e3:>8.1f} {compute / m * 1e3:>8.2f} {overhead * 1e3:>7.2f} "
                  f"{worst['p2p'] * 1e3:>7.2f} {1 - compute / step:>6.3f} "
                  f"{1 - together / step:>8.3f} {bubble:>9.3f}")


if __name__ == "__main__":
    main()
