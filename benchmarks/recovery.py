"""Recovery time after a killed worker, under `paratrain launch --max-restarts 1`.

For static and c10d rendezvous, on one host (2 processes, loopback) and on two
network-namespace hosts (1 process each; needs root), a tiny training job is
started, rank 1 kills itself with SIGKILL at step ``--kill-at`` and the
elastic agent restarts the workers, which resume from the newest checkpoint.
Every worker appends wall-clock events to a shared file; the table reports

* ``restart``: kill -> first worker process of the next attempt running
  (detection, stopping the survivors, re-rendezvous, process start);
* ``resumed``: kill -> first optimizer step after resuming (adds the torch
  import, the process group and loading the checkpoint);
* ``total``: wall time of the whole job.

    python benchmarks/recovery.py                    # all four set-ups
    python benchmarks/recovery.py --repeats 3 --where host
"""

from __future__ import annotations

import time

_STARTED = time.time()  # before the heavy imports: the process start counts

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

PORT = 29500


def log_event(path: str, **event) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(event) + "\n")


def worker(args: argparse.Namespace) -> None:
    """The training job: logs start, steps and the kill; rank 1 dies at ``--kill-at``."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import TensorDataset

    import paratrain

    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    rank = int(os.environ.get("RANK", "0"))
    log_event(args.events, event="start", restart=restart, rank=rank, t=_STARTED)
    with paratrain.Run(accelerator="cpu", progress=False, seed=0,
                       checkpoint_dir=args.checkpoint_dir, checkpoint_every=5) as run:
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(4096, 32, generator=g),
                             torch.randint(0, 4, (4096,), generator=g))
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = run.prepare(model, optimizer)
        loader = run.loader(data, batch_size=16)
        first = True
        for _ in run.epochs(1):
            for x, y in loader:
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
                if first:
                    log_event(args.events, event="step", restart=restart, rank=rank,
                              step=run.global_step, t=time.time())
                    first = False
                if restart == 0 and rank == 1 and run.global_step == args.kill_at:
                    log_event(args.events, event="kill", rank=rank, t=time.time())
                    os.kill(os.getpid(), signal.SIGKILL)
                if run.global_step >= args.kill_at + 10:
                    return


def node_argv(mode: str, k: int, master: str, local: str, nnodes: int, nproc: int,
              run_id: str) -> list[str]:
    argv = [sys.executable, "-m", "paratrain.cli", "launch", "--nnodes", str(nnodes),
            "--nproc-per-node", str(nproc), "--max-restarts", "1", "--join-timeout", "60"]
    if mode == "static":
        # An explicit port keeps it static: without one, a single-node job with restarts
        # is switched to a local c10d rendezvous by the launcher.
        from paratrain.distributed.device import free_port

        port = free_port() if nnodes == 1 else PORT
        return [*argv, "--node-rank", str(k), "--master-addr", master, "--master-port", str(port)]
    argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{PORT}",
             "--rdzv-id", run_id, "--local-addr", local]
    return [*argv, "--rdzv-conf", "is_host=1"] if k == 0 else argv


def measure(mode: str, where: str, kill_at: int, timeout_s: float) -> dict[str, float]:
    """One job; seconds from the kill to restart and to the first resumed step."""
    work = Path(tempfile.mkdtemp(prefix="paratrain-recovery-"))
    events = work / "events.jsonl"
    script = [str(Path(__file__).resolve()), "--worker", "--events", str(events),
              "--checkpoint-dir", str(work / "ckpt"), "--kill-at", str(kill_at)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PARATRAIN_TIMEOUT_S": str(timeout_s)}
    started = time.time()
    if where == "host":
        argv = node_argv(mode, 0, "127.0.0.1", "127.0.0.1", 1, 2, f"rec-{os.getpid()}")
        result = subprocess.run([*argv, *script], env=env, capture_output=True, text=True,
                                timeout=300)
        codes = [result.returncode]
    else:
        from paratrain.testing import netns

        with netns.NetnsCluster(num_hosts=2) as cluster:
            master = cluster.hosts[0].addr
            procs = [host.popen([*node_argv(mode, k, master, host.addr, 2, 1,
                                            f"rec-{cluster.id}"), *script], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                     for k, host in enumerate(cluster.hosts)]
            deadline = time.monotonic() + 300
            while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
                time.sleep(0.1)
            codes = [p.poll() for p in procs]
    total = time.time() - started
    rows = [json.loads(line) for line in events.read_text().splitlines()] if events.exists() else []
    kill = next((e["t"] for e in rows if e["event"] == "kill"), None)
    restart = min((e["t"] for e in rows if e["event"] == "start" and e["restart"] == 1),
                  default=None)
    resumed = min((e["t"] for e in rows if e["event"] == "step" and e["restart"] == 1),
                  default=None)
    if kill is None or resumed is None or any(c != 0 for c in codes):
        return {"ok": 0.0, "total": total}
    return {"ok": 1.0, "restart": restart - kill, "resumed": resumed - kill, "total": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--worker", action="store_true", help=argparse.SUPPRESS)
    add("--events", help=argparse.SUPPRESS)
    add("--checkpoint-dir", help=argparse.SUPPRESS)
    add("--kill-at", type=int, default=12, help="step at which rank 1 is killed")
    add("--repeats", type=int, default=1)
    add("--where", choices=["host", "netns", "both"], default="both")
    add("--timeout-s", type=float, default=10.0, help="collective timeout (PARATRAIN_TIMEOUT_S)")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    wheres = ["host", "netns"] if args.where == "both" else [args.where]
    if "netns" in wheres:
        from paratrain.testing import netns

        ok, reason = netns.netns_available()
        if not ok:
            print(f"skipping namespace hosts: {reason}")
            wheres.remove("netns")
    print("| hosts | rendezvous | recovered | kill -> restart (s) | kill -> resumed step (s) "
          "| job wall time (s) |\n|---|---|---|---|---|---|")
    for where in wheres:
        for mode in ("static", "c10d"):
            runs = [measure(mode, where, args.kill_at, args.timeout_s)
                    for _ in range(args.repeats)]
            good = [r for r in runs if r["ok"]]

            def med(key: str, good=good) -> str:
                return f"{statistics.median(r[key] for r in good):.1f}" if good else "-"

            label = "1 host x 2 procs" if where == "host" else "2 netns hosts x 1 proc"
            print(f"| {label} | {mode} | {len(good)}/{len(runs)} | {med('restart')} | "
                  f"{med('resumed')} | {med('total')} |", flush=True)


if __name__ == "__main__":
    main()
