"""Per-step cost of recording collectives and loop phases (paratrain.reliability.collectives, paratrain.reliability.hang).

    python benchmarks/collective_record.py --repeats 7 --steps 20

Two gloo ranks train the demo ConvNet with DDP (batch 64 per rank, Adam, one
``run.mean(loss)`` per step, as a logging loop does). Each repeat times
``--steps`` steps with recording on (the default: 3 phase marks and the
recorded all_reduce per step, watchdog thread running) and with it off, the
order alternating between repeats so drift in machine load hits both alike.
Because a difference under 1% is below the noise of a shared machine, the
recording itself is also timed in isolation (phase marks and a wrapped call
with a no-op in place of the collective) and set against the median step time.
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit

import torch
import torch.nn.functional as F


def _steps(run, model, optimizer, x, y, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        run.backward(loss)
        run.step(optimizer)
        run.mean(loss)
    return (time.perf_counter() - start) / steps


def worker(rank: int, world_size: int, repeats: int, steps: int) -> dict[str, list[float]]:
    import paratrain
    from paratrain.models import convnet
    from paratrain.reliability import hang

    run = paratrain.Run(strategy="ddp", progress=False)
    try:
        model = convnet()
        model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3))
        generator = torch.Generator().manual_seed(rank)
        x = torch.randn(64, 1, 28, 28, generator=generator)
        y = torch.randint(0, 10, (64,), generator=generator)
        on = run._hang
        off = hang.HangMonitor(rank=rank, world_size=world_size, hosts=[], warn_after_s=0)
        _steps(run, model, optimizer, x, y, 3)  # warm-up
        times: dict[str, list[float]] = {"on": [], "off": []}
        for repeat in range(repeats):
            for variant in (("on", "off") if repeat % 2 == 0 else ("off", "on")):
                if variant == "on":
                    on.recorder.install()
                    run._hang = on
                else:
                    on.recorder.close()
                    run._hang = off
                times[variant].append(_steps(run, model, optimizer, x, y, steps))
        run._hang = on
        return times
    finally:
        run.close()


def isolated_costs() -> tuple[float, float]:
    """Seconds per phase mark and per recorded call (recording only, no communication)."""
    from paratrain.reliability.collectives import CollectiveRecorder

    recorder = CollectiveRecorder()

    def noop(tensor, op=None, group=None, async_op=False):  # all_reduce's signature
        return None

    wrapped = recorder._wrap("all_reduce", noop)
    tensor = torch.zeros(4)

    def phase() -> None:
        with recorder.phase_scope("step"):
            pass

    n = 20_000
    phase_s = min(timeit.repeat(phase, number=n, repeat=5)) / n
    call_s = (min(timeit.repeat(lambda: wrapped(tensor), number=n, repeat=5))
              - min(timeit.repeat(lambda: noop(tensor), number=n, repeat=5))) / n
    return phase_s, call_s


def main() -> int:
    from paratrain.distributed.spawn import spawn

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    times = spawn(worker, 2, args.repeats, args.steps, timeout=1800)[0]
    ratios = [a / b for a, b in zip(times["on"], times["off"])]
    print(f"{'recording':<10} {'median ms/step':>15} {'min':>8} {'max':>8}")
    for variant in ("on", "off"):
        ms = [t * 1e3 for t in times[variant]]
        print(f"{variant:<10} {statistics.median(ms):15.2f} {min(ms):8.2f} {max(ms):8.2f}")
    print(f"\npaired ratio on/off: median {statistics.median(ratios):.4f}, "
          f"min {min(ratios):.4f}, max {max(ratios):.4f} over {len(ratios)} repeats")
    phase_s, call_s = isolated_costs()
    per_step = 3 * phase_s + call_s
    step = statistics.median(times["off"])
    print(f"isolated: phase mark {phase_s * 1e6:.2f} us, recorded call +{call_s * 1e6:.2f} us; "
          f"per step (3 marks + 1 call) {per_step * 1e6:.1f} us = "
          f"{100 * per_step / step:.3f}% of the median step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
