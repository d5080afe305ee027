"""DiLoCo against DDP on a slow link: tokens/s and validation loss at equal tokens.

    python benchmarks/diloco_slow_link.py --plot docs/img/diloco_slow_link.png
    python benchmarks/diloco_slow_link.py --quick        # a smoke check, ~1 minute

Two network-namespace hosts (:class:`paratrain.testing.netns.NetnsCluster`), one process
each, joined by a link of ``--rate-mbit`` (100) with ``--delay-ms`` (20) one-way delay in
each direction (round trip 40 ms): ``tc netem`` where the kernel has it, else the
user-space forwarder of :mod:`paratrain.testing.slowlink` with the same model (FIFO at the
rate, then the delay). On it, ``examples/gpt_shakespeare.py`` runs twice for the same
steps, global batch and seed, launched with ``paratrain launch --nnodes 2`` (static
rendezvous): once with ``--strategy ddp`` (gradients all-reduced every step) and once
with ``--semi-sync diloco:H`` (each host a replica taking H AdamW steps alone, then one
outer Nesterov step on the averaged pseudo-gradients). Validation runs every H steps,
right after an outer step, so both are measured on synchronised parameters at equal
tokens. tokens/s are the example's own: global tokens over the seconds of training
steps (validation excluded).

Printed: the link, both runs' curves side by side, the tokens/s ratio (target >= 5) and
the relative validation-loss gap at the last point (target within 3%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from paratrain.testing import netns, slowlink

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt_shakespeare.py"
PORT = 29500  # every namespace has its own port space
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def shape(cluster: netns.NetnsCluster, args: argparse.Namespace) -> str:
    """Slow the link between hosts 0 and 1; the way it was done, in words."""
    if args.link == "none":
        return "unshaped veth bridge (a reference)"
    if args.link in ("auto", "netem"):
        try:
            for index in range(2):
                cluster.shape_link(index, rate=f"{args.rate_mbit:g}mbit",
                                   delay_ms=args.delay_ms)
            return "tc netem on both veths"
        except netns.NetnsUnavailable:
            if args.link == "netem":
                raise
    slowlink.connect(cluster, args.rate_mbit, args.delay_ms)
    return "user-space tun forwarder (paratrain.testing.slowlink; no sch_netem here)"


def example_argv(args: argparse.Namespace, out: Path, extra: list[str]) -> list[str]:
    return [str(EXAMPLE), "--no-progress", "--seed", str(args.seed), "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--block-size", str(args.block_size),
            "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
            "--n-head", str(args.n_head), "--lr", str(args.lr), "--warmup", str(args.warmup),
            "--eval-every", str(args.every), "--eval-samples", str(args.eval_samples),
            "--json", str(out), *extra]


def run_variant(name: str, extra: list[str], args: argparse.Namespace, workdir: Path) -> dict:
    """One training run on a fresh pair of hosts; the example's JSON summary + wall_s."""
    out, logs = workdir / f"{name}.json", [workdir / f"{name}.node{k}.log" for k in range(2)]
    with netns.NetnsCluster(num_hosts=2) as cluster:
        link = shape(cluster, args)
        master = cluster.hosts[0].addr
        procs = []
        started = time.monotonic()
        for k, host in enumerate(cluster.hosts):
            argv = [sys.executable, "-m", "paratrain.cli", "launch", "--nnodes", "2",
                    "--nproc-per-node", "1", "--join-timeout", "60", "--node-rank", str(k),
                    "--master-addr", master, "--master-port", str(PORT),
                    *example_argv(args, out, extra)]
            with open(logs[k], "w") as log:
                procs.append(host.popen(argv, env={**os.environ, **ENV}, stdout=log,
                                        stderr=subprocess.STDOUT))
        while any(p.poll() is None for p in procs) and time.monotonic() - started < args.timeout:
            time.sleep(0.5)
        wall = time.monotonic() - started
        codes = [p.poll() for p in procs]
    if codes != [0, 0]:
        tails = "\n".join(f"--- node {k} (exit {c}) ---\n{logs[k].read_text()[-2000:]}"
                          for k, c in enumerate(codes))
        raise RuntimeError(f"{name} failed (exit codes {codes}, {wall:.0f} s):\n{tails}")
    summary = json.loads(out.read_text())
    return {**summary, "wall_s": wall, "link": link, "name": name}


def curve(result: dict, tokens_per_step: int) -> list[tuple[int, float, float]]:
    """(tokens, val loss, training seconds so far) per validation point."""
    return [(row["step"] * tokens_per_step, row["val_loss"],
             row["step"] * tokens_per_step / row["tokens_per_s"]) for row in result["history"]]


def report(ddp: dict, diloco: dict, args: argparse.Namespace) -> dict:
    tps = args.batch_size * args.block_size
    a, b = curve(ddp, tps), curve(diloco, tps)
    print("| tokens | val loss ddp | val loss diloco | gap | ddp train s | diloco train s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for (tokens, loss_a, sec_a), (_, loss_b, sec_b) in zip(a, b):
        print(f"| {tokens:,} | {loss_a:.4f} | {loss_b:.4f} | {100 * (loss_b / loss_a - 1):+.2f}% "
              f"| {sec_a:.1f} | {sec_b:.1f} |")
    print()
    print("| run | steps | tokens | tokens/s | train s | wall s (start-up, validation) "
          "| final val loss |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, res in ((f"ddp ({ddp['strategy']})", ddp),
                       (f"DiLoCo H={args.every} ({diloco['strategy']})", diloco)):
        tokens = res["steps"] * tps
        print(f"| {label} | {res['steps']} | {tokens:,} | {res['tokens_per_s']:.0f} | "
              f"{tokens / res['tokens_per_s']:.1f} | {res['wall_s']:.0f} | "
              f"{res['val_loss']:.4f} |")
    ratio = diloco["tokens_per_s"] / ddp["tokens_per_s"]
    gap = diloco["val_loss"] / ddp["val_loss"] - 1
    print(f"\ntokens/s ratio DiLoCo / DDP: {ratio:.2f}x (target >= 5: "
          f"{'met' if ratio >= 5 else 'MISSED'})")
    print(f"validation loss at {ddp['steps'] * tps:,} tokens: DDP {ddp['val_loss']:.4f}, "
          f"DiLoCo {diloco['val_loss']:.4f}, gap {100 * gap:+.2f}% (target within 3%: "
          f"{'met' if abs(gap) <= 0.03 else 'MISSED'})")
    return {"ratio": ratio, "gap": gap, "ddp": a, "diloco": b}


def plot(numbers: dict, ddp: dict, diloco: dict, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for key, res, label in (("ddp", ddp, "DDP"), ("diloco", diloco, f"DiLoCo H={args.every}")):
        tokens, loss, seconds = zip(*numbers[key])
        left.plot(tokens, loss, marker="o", label=f"{label} ({res['tokens_per_s']:.0f} tokens/s)")
        right.plot(seconds, loss, marker="o", label=label)
    left.xaxis.set_major_formatter(lambda x, _: f"{x / 1e3:.0f}k")
    left.set(xlabel="training tokens", ylabel="validation loss (nats/char)",
             title="loss at equal tokens")
    right.set(xlabel="training seconds (validation excluded)", ylabel="validation loss",
              title="loss against time")
    for axes in (left, right):
        axes.grid(alpha=0.3)
        axes.legend(loc="upper right", fontsize=9)
    fig.suptitle(f"GPT {args.n_layer}x{args.n_embd} on Shakespeare, 2 hosts, "
                 f"{args.rate_mbit:g} Mbit/s, {args.delay_ms:g} ms one-way delay; DiLoCo outer lr "
                 f"{args.outer_lr:g}, Nesterov momentum {args.outer_momentum:g}", fontsize=10)
    fig.tight_layout()
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--steps", type=int, default=1000)
    add("--every", type=int, default=50, help="DiLoCo's H; also the validation interval")
    add("--outer-lr", type=float, default=0.7)
    add("--outer-momentum", type=float, default=0.9)
    add("--batch-size", type=int, default=8, help="global sequences per step")
    add("--block-size", type=int, default=64)
    add("--n-layer", type=int, default=4)
    add("--n-head", type=int, default=4)
    add("--n-embd", type=int, default=128)
    add("--lr", type=float, default=2e-3)
    add("--warmup", type=int, default=30)
    add("--eval-samples", type=int, default=256)
    add("--seed", type=int, default=0)
    add("--rate-mbit", type=float, default=100.0)
    add("--delay-ms", type=float, default=20.0, help="one-way, each direction")
    add("--link", choices=("auto", "netem", "userspace", "none"), default="auto")
    add("--only", choices=("ddp", "diloco"), default=None, help="run one variant")
    add("--timeout", type=float, default=1800.0, help="seconds per run")
    add("--plot", default=None, metavar="PNG")
    add("--json", default=None, metavar="PATH", help="both runs' summaries")
    add("--quick", action="store_true", help="a smoke check: 100 steps, H=25, 64 val samples")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.every, args.eval_samples = 100, 25, 64
    ok, reason = netns.netns_available()
    if not ok:
        print(f"diloco_slow_link.py: needs network namespaces: {reason}", file=sys.stderr)
        return 2
    netns.cleanup_stale()
    diloco_flag = (f"diloco:{args.every},outer_lr={args.outer_lr},"
                   f"outer_momentum={args.outer_momentum},nesterov=True")
    variants = {"ddp": ["--strategy", "ddp"], "diloco": ["--semi-sync", diloco_flag]}
    print(f"GPT {args.n_layer}x{args.n_embd}, {args.steps} steps of {args.batch_size} x "
          f"{args.block_size} tokens, 2 hosts x 1 process (gloo, 1 thread each), load "
          f"average {os.getloadavg()[0]:.1f}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="dlc_") as tmp:
        for name, extra in variants.items():
            if args.only in (None, name):
                results[name] = run_variant(name, extra, args, Path(tmp))
                print(f"{name}: {results[name]['tokens_per_s']:.0f} tokens/s, val loss "
                      f"{results[name]['val_loss']:.4f}, {results[name]['wall_s']:.0f} s wall; "
                      f"link: {results[name]['link']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if len(results) < 2:
        return 0
    numbers = report(results["ddp"], results["diloco"], args)
    if args.plot:
        plot(numbers, results["ddp"], results["diloco"], args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
