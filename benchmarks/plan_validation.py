"""Does ``paratrain plan`` predict real step times? Predicted vs measured, side by side.

Real training jobs (``paratrain.bench.worker`` under ``paratrain launch``) of each
strategy in ``--strategies`` that the registry has (``ps`` is included automatically
once registered) with 2-3 workers:

* on loopback (one machine, ``--nproc-per-node W``), and
* across network-namespace hosts (one process per host) whose links are rate-limited
  with ``tc tbf`` in both directions (e.g. 1gbit, 200mbit); needs root and iproute2,
  otherwise those rows are skipped with the reason.

Prediction: :func:`paratrain.plan.predict` with the model's sizes from
:func:`paratrain.plan.calibration` and the compute time from the job's own gradient-sync-free
phase ("in-situ calibration": the emulated hosts share this machine's cores, so a
process's compute speed depends on how many run at once). The link is the tbf rate
(loopback: the job's all-reduce probe); the latency comes from the job's 4-byte
all-reduce probe. The column ``pred(1 proc)`` uses the single-process calibration
instead, to show what CPU sharing does.

    python benchmarks/plan_validation.py                       # full run, a few minutes
    python benchmarks/plan_validation.py --workers 2 --steps 5 --repeats 2 --links loopback,200mbit

``tp`` and ``fsdp_tp`` need a model with transformer blocks and token inputs; their
compute is the one-process calibration slowed by the ``ddp`` job's contention factor
(``plan_validation_tp.py``), so run ``ddp`` beside them:

    python benchmarks/plan_validation.py --strategies ddp,tp --workers 2 --links loopback \
        --model paratrain.models:gpt_bench --input-shape 64 --vocab-size 512 --batch-size 8

``--single-device`` instead compares one device only, where the job runs by default (a
GPU when visible): the plan's calibrated single-device step (forward, backward and the
optimizer step, calibrated on that device) against a real ``single`` bench job's.

    python benchmarks/plan_validation.py --single-device --model torchvision.models:resnet18 \
        --input-shape 3,224,224
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
from plan_validation_tp import (
    TENSOR_STRATEGIES,
    calibrate_at,
    cell_order,
    contention,
    dispatch_time,
    split_ratio,
    tensor_profile,
    without_tensor_fields,
)

from paratrain.bench import jobs as bench_jobs
from paratrain.bench.report import link_from_probe
from paratrain.bench.worker import DEMO_MODEL, JobSpec, load_factory
from paratrain.parallel.options import Pipeline
from paratrain.plan import Hardware, parse_bandwidth, predict
from paratrain.strategies import available_strategies
from paratrain.strategies.pipeline.module import microbatches_for

PORT = 29500  # every namespace has its own port space


def _shape_both_ways(cluster, index: int, rate: str) -> None:
    """tbf on the host's egress (the harness) and on its bridge port (the host's ingress),
    so each host has a symmetric link like a real NIC."""
    burst = "512kb" if parse_bandwidth(rate) >= parse_bandwidth("1gbit") else "256kb"
    cluster.limit_rate(index, rate=rate, burst=burst)
    host = cluster.hosts[index]
    subprocess.run(["tc", "-n", cluster.bridge_netns, "qdisc", "replace", "dev",
                    host.bridge_port, "root", "tbf", "rate", rate, "burst", burst,
                    "latency", "50ms"], check=True, capture_output=True, timeout=30)


def run_netns(spec_path: Path, out_dir: Path, *, strategy: str, workers: int, rate: str,
              timeout: float) -> bench_jobs.JobOutcome:
    """One process per namespace host, static rendezvous on host 0, all links shaped."""
    from paratrain.testing import netns

    servers, server_flags = bench_jobs.server_args(strategy)
    num_hosts = workers + servers
    out_dir.mkdir(parents=True, exist_ok=True)
    env = bench_jobs.job_env(threads=1)
    with netns.NetnsCluster(num_hosts=num_hosts) as cluster:
        for i in range(num_hosts):
            _shape_both_ways(cluster, i, rate)
        procs, logs = [], []
        for k, host in enumerate(cluster.hosts):
            argv = [sys.executable, "-m", "paratrain.cli", "launch", "--nnodes", str(num_hosts),
                    "--nproc-per-node", "1", "--node-rank", str(k), "--master-addr",
                    cluster.hosts[0].addr, "--master-port", str(PORT), *server_flags,
                    *bench_jobs.worker_argv(spec_path, out_dir)]
            log = open(out_dir / f"host{k}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(host.popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT))
        try:
            failure = bench_jobs.wait_all(procs, timeout)
        finally:
            for log in logs:
                log.close()
    text = "\n".join((out_dir / f"host{k}.log").read_text(errors="replace")
                     for k in range(num_hosts))
    return bench_jobs.collect(out_dir, failure, text)


def measure(args, strategy: str, workers: int, link: str, root: Path) -> bench_jobs.JobOutcome:
    job = root / f"{strategy}-{workers}-{link}"
    job.mkdir(parents=True, exist_ok=True)
    spec = JobSpec(strategy=strategy, model=args.model, input_shape=args.input_shape,
                   vocab_size=args.vocab_size, batch_size=args.batch_size,
                   warmup_steps=args.warmup, steps=args.steps, repeats=args.repeats,
                   link_probe_bytes=args.probe_bytes)
    spec.write(job / "spec.json")
    if link == "loopback":
        argv = bench_jobs.local_launch_argv(job / "spec.json", job / "out", strategy=strategy,
                                            world_size=workers)
        return bench_jobs.run_local(argv, job / "out", env=bench_jobs.job_env(threads=1),
                                    timeout=args.timeout)
    return run_netns(job / "spec.json", job / "out", strategy=strategy, workers=workers,
                     rate=link, timeout=args.timeout)


def overlap_for(strategy: str, first: dict) -> float:
    """The planner's ``overlap`` for this job's devices.

    On CUDA, NCCL runs on its own stream and hides behind backward (1.0). On CPU,
    gloo reduces and copies on CPU threads: when every core already runs a compute
    thread (one process per core here, and the namespace hosts share this machine's
    cores), a collective waits for compute instead of overlapping it (0.0). A
    pipeline's point-to-point transfers do no arithmetic: the schedule posts them
    (``batch_isend_irecv``) and computes the next micro-batch while the network stack
    moves them, so they overlap on CPU too (1.0).
    """
    if strategy == "pipeline" or first.get("device", "cpu").startswith("cuda"):
        return 1.0
    return 0.0


def predicted_step(profile, strategy: str, workers: int, link: str, first: dict) -> float:
    bus, latency = link_from_probe(first)
    latency = 50e-6 if latency is None else latency
    if link == "loopback":
        hw = Hardware(num_devices_per_node=workers, intra_node_bandwidth=bus,
                      intra_node_latency=latency)
    else:
        hw = Hardware(num_nodes=workers, num_devices_per_node=1,
                      inter_node_bandwidth=parse_bandwidth(link), inter_node_latency=latency)
    kwargs = {"batch_size_per_device": first["batch_size"]}
    if strategy == "pipeline":
        # The job's stages share one mini-batch of batch_size samples (no data parallelism)
        # in the strategy's default number of micro-batches; the planner's mini-batch is
        # p x batch_size_per_device.
        kwargs = {"batch_size_per_device": first["batch_size"] // workers,
                  "num_microbatches": pipeline_microbatches(first["batch_size"])}
    return predict(strategy, profile, hw, overlap=overlap_for(strategy, first),
                   **kwargs).step_time


def pipeline_microbatches(batch_size: int) -> int:
    """Micro-batches the pipeline job cuts its mini-batch into (the strategy's default)."""
    return microbatches_for(batch_size, Pipeline().microbatches)


def calibrate_micro(model, args):
    """The model calibrated on one process at the pipeline's micro-batch size."""
    return calibrate_at(model, args, args.batch_size // pipeline_microbatches(args.batch_size))


def validate_single(args) -> int:
    """Plan's calibrated single-device step vs a real ``single`` job on the same device."""
    from plan_validation_tp import example_batch

    from paratrain.bench.worker import make_loss
    from paratrain.plan import calibrate
    from paratrain.plan.device import select_device

    device = select_device(None)
    if device.type == "cpu":
        torch.set_num_threads(1)  # as the job's process (OMP_NUM_THREADS=1)
    spec = JobSpec(strategy="single", model=args.model, input_shape=args.input_shape,
                   vocab_size=args.vocab_size, batch_size=args.batch_size,
                   warmup_steps=args.warmup, steps=args.steps, repeats=args.repeats,
                   link_probe_bytes=args.probe_bytes)
    model = load_factory(args.model)()
    example = example_batch(args, args.batch_size)
    with torch.no_grad():
        loss = make_loss(model(example), args.batch_size, torch.Generator().manual_seed(0),
                         vocab_size=args.vocab_size)
    profile = calibrate(model, example, loss, repeats=5, device=device, optimizer=spec.optimizer)
    predicted = predict("single", profile, Hardware(), batch_size_per_device=args.batch_size)
    with tempfile.TemporaryDirectory(prefix="plan-validation-") as tmp:
        job = Path(args.workdir or tmp) / "single-1"
        job.mkdir(parents=True, exist_ok=True)
        spec.write(job / "spec.json")
        argv = bench_jobs.local_launch_argv(job / "spec.json", job / "out", strategy="single",
                                            world_size=1)
        threads = 1 if device.type == "cpu" else None
        outcome = bench_jobs.run_local(argv, job / "out", env=bench_jobs.job_env(threads=threads),
                                       timeout=args.timeout)
    if not outcome.ok:
        print(f"single: failed, {outcome.reason}")
        return 1
    first = outcome.results[0]
    measured = statistics.median(first["step_s"])
    error = predicted.step_time / measured - 1
    print(f"{args.model} on {first['device']} (plan calibrated on {device}), batch "
          f"{args.batch_size}: measured {measured * 1e3:.3f} ms, predicted "
          f"{predicted.step_time * 1e3:.3f} ms (compute {predicted.compute_time * 1e3:.3f} + "
          f"optimizer {predicted.optimizer_time * 1e3:.3f}), error {error:+.1%}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "device": first["device"],
                                               "measured_s": measured,
                                               "predicted_s": predicted.step_time,
                                               "error": error}, indent=2) + "\n")
    return 0 if abs(error) <= args.tolerance else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--strategies", default="ddp,ps")
    p.add_argument("--workers", default="2,3")
    p.add_argument("--links", default="loopback,1gbit,200mbit", help="loopback and/or tc rates")
    p.add_argument("--model", default=DEMO_MODEL)
    p.add_argument("--input-shape", default="1,28,28")
    p.add_argument("--vocab-size", type=int, help="feed int64 tokens below this (a GPT)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--probe-bytes", type=int, default=4_000_000)
    p.add_argument("--tolerance", type=float, default=0.20)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", help="also write the rows here")
    p.add_argument("--workdir", help="keep each job's spec, per-rank JSON and logs here")
    p.add_argument("--single-device", action="store_true",
                   help="compare one device's step only (on a GPU when visible)")
    args = p.parse_args(argv)
    args.input_shape = tuple(int(x) for x in args.input_shape.split(","))
    if args.single_device:
        return validate_single(args)
    links = [s.strip() for s in args.links.split(",") if s.strip()]
    for link in links:
        if link != "loopback":
            parse_bandwidth(link)  # fail now, not after the first job

    torch.set_num_threads(1)  # as each job's processes (OMP_NUM_THREADS=1)
    model = load_factory(args.model)()
    # The jobs run on CPU, with Adam (the bench default).
    base = calibrate_at(model, args, args.batch_size, optimizer="adam")
    print(f"calibrated {args.model}: {base.num_parameters:,} parameters, "
          f"{base.compute_time_per_sample * 1e3:.3f} ms/sample on one process, "
          f"backward share {base.backward_fraction:.2f}, {base.num_layers} layers, "
          f"optimizer step {base.optimizer_step_time * 1e3:.1f} ms")
    if base.tp_allreduces:
        print(f"  tensor parallel: {base.tp_allreduces} all-reduces of "
              f"{base.tp_allreduce_bytes_per_sample / base.tp_allreduces:,.0f} bytes/sample, "
              f"split share: compute {base.tp_split_fraction:.3f}, "
              f"parameters {base.tp_split_param_fraction:.3f}")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    # The pipeline's stages compute micro-batches: one calibration at that size serves
    # every pipeline cell (its size does not depend on the number of stages).
    micro = calibrate_micro(model, args) if "pipeline" in strategies else None

    from paratrain.testing import netns

    netns_ok, netns_reason = netns.netns_available()
    rows, lines, firsts, ratios = [], [], {}, {}
    with tempfile.TemporaryDirectory(prefix="plan-validation-") as tmp:
        root = Path(args.workdir or tmp)
        for strategy in [s for s in strategies if s not in available_strategies()]:
            lines.append(f"{strategy}: skipped, not in the strategy registry")
        registered = [s for s in strategies if s in available_strategies()]
        worker_counts = [int(w) for w in args.workers.split(",")]
        for strategy, workers, link in cell_order(registered, worker_counts, links):
            if link != "loopback" and not netns_ok:
                lines.append(f"{strategy} x{workers} {link}: skipped, {netns_reason}")
                continue
            if strategy == "fsdp_tp" and workers % 2:
                lines.append(f"{strategy} x{workers} {link}: skipped, tensor degree 2 "
                             f"does not divide {workers} workers")
                continue
            if strategy == "pipeline" and args.batch_size % workers:
                lines.append(f"{strategy} x{workers} {link}: skipped, --batch-size "
                             f"{args.batch_size} does not split over {workers} stages")
                continue
            outcome = measure(args, strategy, workers, link, root)
            if not outcome.ok:
                lines.append(f"{strategy} x{workers} {link}: failed, {outcome.reason}")
                continue
            first = outcome.results[0]
            firsts[strategy, workers, link] = first
            compute = statistics.median(first["compute_step_s"]) + first["optimizer_step_s"]
            # The optimizer step is inside the in-situ compute.
            situ = replace(base, compute_time_per_sample=compute / args.batch_size,
                           optimizer_step_time=0.0)
            one_proc = base
            if strategy == "pipeline":
                # Its sync-free phase still runs the whole schedule (stages exchange
                # activations inside no_sync too): not one device's compute. Each
                # stage is one process on its own core and computes micro-batches,
                # so one process's calibration at the micro-batch size is the input.
                situ = micro
            if strategy in TENSOR_STRATEGIES:
                # Its "compute" phase holds its activation all-reduces (see
                # plan_validation_tp.py); ddp's says how slow one process is here.
                degree = workers if strategy == "tp" else 2
                if degree not in ratios:
                    ratios[degree] = split_ratio(args, degree)
                dispatch = dispatch_time(base, ratios[degree], degree, args.batch_size)
                factor = contention(base, firsts.get(("ddp", workers, link)))
                situ = tensor_profile(base, factor, dispatch)
                one_proc = tensor_profile(base, 1.0, dispatch)
                compute = (args.batch_size * situ.compute_time_per_sample
                           + situ.optimizer_step_time)
                fallback = predicted_step(without_tensor_fields(situ), strategy,
                                          workers, link, first)
                lines.append(f"{strategy} x{workers} {link}: compute = one process x "
                             f"{factor:.2f} (ddp's contention); a rank alone computes "
                             f"{ratios[degree]:.2f} of the whole model (dispatch "
                             f"{dispatch * 1e3:.1f} ms/step at one process); without "
                             f"the tp_* profile fields the plan predicts "
                             f"{fallback * 1e3:.1f} ms")
            measured = statistics.median(first["step_s"])
            row = {"link": link, "strategy": strategy, "workers": workers,
                   "compute_s": compute, "measured_s": measured,
                   "measured_min_s": min(first["step_s"]),
                   "measured_max_s": max(first["step_s"]),
                   "predicted_s": predicted_step(situ, strategy, workers, link, first),
                   "predicted_1proc_s": predicted_step(one_proc, strategy, workers, link,
                                                       first)}
            row["error"] = row["predicted_s"] / measured - 1
            if strategy in TENSOR_STRATEGIES:
                row["predicted_fallback_s"] = fallback
            row["probe_bus_bandwidth"] = link_from_probe(first)[0]
            rows.append(row)
            print(f"  {strategy} x{workers} {link}: measured {measured * 1e3:.1f} ms, "
                  f"predicted {row['predicted_s'] * 1e3:.1f} ms", flush=True)
    # The table in the order of --strategies, --workers, --links, however they ran.
    rows.sort(key=lambda r: (strategies.index(r["strategy"]), r["workers"],
                             links.index(r["link"])))
    head = ("link", "strategy", "workers", "probe bus bw", "compute", "measured (min-max)",
            "predicted", "ratio", "error", "pred(1 proc)")
    table = [head] + [(r["link"], r["strategy"], str(r["workers"]),
                       f"{r['probe_bus_bandwidth'] * 8 / 1e6:,.0f} Mbit/s", f"{r['compute_s'] * 1e3:.1f} ms",
                       f"{r['measured_s'] * 1e3:.1f} ms ({r['measured_min_s'] * 1e3:.0f}-"
                       f"{r['measured_max_s'] * 1e3:.0f})", f"{r['predicted_s'] * 1e3:.1f} ms",
                       f"{1 + r['error']:.2f}", f"{r['error']:+.1%}", f"{r['predicted_1proc_s'] * 1e3:.1f} ms")
                      for r in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    print()
    for i, r in enumerate(table):
        print("  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    for line in lines:
        print(line)
    within = sum(abs(r["error"]) <= args.tolerance for r in rows)
    print(f"\n{within}/{len(rows)} predictions within {args.tolerance:.0%} of the measured step time")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "notes": lines}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
