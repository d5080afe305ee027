"""``paratrain launch``: torchrun's command line on top of ``torch.distributed.run``.

The flags are torchrun's; the processes are started, watched and restarted by
torchrun's elastic agent. What paratrain adds:

* checks that fail fast with one line (script missing, port in use, bad node
  rank, ...), a free port when a single-node job does not name one, and CPU
  thread defaults that split the cores among the local processes;
* a line when a wait lasts (the master, the other nodes; every
  ``PARATRAIN_WAIT_REPORT_S``, default 30 s) and one line when it times out;
* one report when the job ends badly: the first failed rank's traceback once
  and a line naming it (:mod:`paratrain.launch.report`); Ctrl-C and SIGTERM
  end with one line and exit code 130 / 143 (torch's agent forwards the signal
  to the workers, which checkpoint when they have a checkpoint directory);
* workers run through :mod:`paratrain.launch.worker`, which releases a process
  group left to interpreter exit.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence

import psutil

from paratrain.distributed.device import cpu_threads_per_process, free_port
from paratrain.launch import fault_tolerant, kubernetes, preflight, slurm
from paratrain.launch import report as launch_report
from paratrain.launch import worker as launch_worker
from paratrain.launch.argv import misplaced_flags_notice
from paratrain.reliability import signals, waits
from paratrain.settings import DEFAULT_WAIT_REPORT_S, Settings

NPROC_WORDS = ("auto", "cpu", "gpu", "xpu")


class LaunchError(ValueError):
    """A launch request that cannot work; the message says why and how to fix it."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="paratrain launch",
        allow_abbrev=False,
        description="Start a training script on one or many nodes (torchrun-compatible flags).",
    )
    add = parser.add_argument
    add("--nnodes", default="1", help="number of nodes, or MIN:MAX for elastic jobs")
    add("--node-rank", "--node_rank", type=int, default=0, help="rank of this node")
    add("--nproc-per-node", "--nproc_per_node", default="1",
        help="processes per node: a number, or auto (one per GPU, else per CPU core)")
    add("--master-addr", "--master_addr", default="127.0.0.1", help="address of node 0")
    add("--master-port", "--master_port", type=int, default=None,
        help="port on node 0 (default: a free port for single-node jobs, else 29500)")
    add("--rdzv-backend", "--rdzv_backend", default="static", help="static or c10d")
    add("--rdzv-endpoint", "--rdzv_endpoint", default="", help="HOST:PORT of the rendezvous")
    add("--rdzv-id", "--rdzv_id", default="none", help="job id shared by all nodes")
    add("--rdzv-conf", "--rdzv_conf", default="", help="extra rendezvous settings, k=v,...")
    add("--local-addr", "--local_addr", default=None, help="this node's address for c10d")
    add("--max-restarts", "--max_restarts", type=int, default=0,
        help="restart all workers up to N times after a failure")
    add("--monitor-interval", "--monitor_interval", type=float, default=0.1,
        help="seconds between checks of worker health")
    add("--join-timeout", type=float, default=300.0,
        help="seconds a node waits for the master / the other nodes before failing")
    add("--standalone", action="store_true",
        help="single-node job with a local rendezvous on a free port")
    add("--ps-servers", type=int, default=None,
        help="number of parameter-server ranks for strategy='ps'")
    add("--parallel", default=None,
        help="the layout as degrees, e.g. dp_shard=2,tp=2 (sets PARATRAIN_PARALLEL)")
    add("--share-gpus", action="store_true",
        help="allow more processes than GPUs per node (round-robin, gloo); for testing only")
    preflight.add_arguments(parser)
    fault_tolerant.add_arguments(parser)
    add("-m", "--module", action="store_true", help="run SCRIPT as a Python module")
    add("--no-python", "--no_python", action="store_true", help="run SCRIPT as an executable")
    add("script", help="training script (or module with -m)")
    # argparse marks a REMAINDER positional required, so a bare `paratrain launch`
    # would name script_args as missing; only the script is.
    add("script_args", nargs=argparse.REMAINDER, help="arguments for the script").required = False
    return parser


def _parse_nnodes(value: str) -> tuple[int, int]:
    try:
        parts = [int(p) for p in value.split(":")]
    except ValueError:
        raise LaunchError(f"--nnodes must be N or MIN:MAX, got {value!r}") from None
    low, high = (parts[0], parts[0]) if len(parts) == 1 else (parts[0], parts[-1])
    if len(parts) > 2 or low < 1 or high < low:
        raise LaunchError(f"--nnodes must be N >= 1 or MIN:MAX with 1 <= MIN <= MAX, got {value!r}")
    return low, high


def _is_local_address(host: str) -> bool:
    if host in ("localhost", "127.0.0.1", "::1", "0.0.0.0") or host.startswith("127."):
        return True
    try:
        return host in (socket.gethostname(), socket.getfqdn())
    except OSError:
        return False


def port_in_use(host: str, port: int) -> bool:
    """True when nothing can listen on ``host:port`` because something already does."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def validate(args: argparse.Namespace) -> None:
    """Fail fast, with one line, on requests that cannot work."""
    low, high = _parse_nnodes(args.nnodes)
    nproc = args.nproc_per_node
    if nproc not in NPROC_WORDS:
        try:
            if int(nproc) < 1:
                raise ValueError
        except ValueError:
            raise LaunchError(
                f"--nproc-per-node must be an integer >= 1 or one of {NPROC_WORDS}, got {nproc!r}"
            ) from None
    if args.rdzv_backend == "static" and not 0 <= args.node_rank < high:
        raise LaunchError(
            f"--node-rank {args.node_rank} is out of range for --nnodes {args.nnodes}; "
            f"use 0..{high - 1}"
        )
    if args.rdzv_backend == "static" and low != high:
        raise LaunchError("--nnodes MIN:MAX needs --rdzv-backend c10d (static needs a fixed size)")
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if not args.join_timeout > 0:
        raise LaunchError(f"--join-timeout must be > 0 seconds, got {args.join_timeout}")
    if not (args.module or args.no_python) and not os.path.isfile(args.script):
        raise LaunchError(f"script {args.script!r} not found; check the path")
    if args.ps_servers is not None and args.ps_servers < 1:
        raise LaunchError(f"--ps-servers must be >= 1, got {args.ps_servers}")
    if args.parallel is not None:
        from paratrain.parallel import Parallel

        try:
            Parallel.from_environment(args.parallel)
        except ValueError as exc:
            raise LaunchError(f"--parallel: {exc}") from None
    static_master = args.rdzv_backend == "static" and not args.standalone
    if static_master and args.master_port is not None:
        if not 0 < args.master_port < 65536:
            raise LaunchError(f"--master-port must be in 1..65535, got {args.master_port}")
        if args.node_rank == 0 and _is_local_address(args.master_addr) and port_in_use(
            args.master_addr, args.master_port
        ):
            raise LaunchError(
                f"port {args.master_port} on {args.master_addr} is in use; pick another "
                "--master-port (or omit it on a single node to get a free one)"
            )


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """The equivalent ``torch.distributed.run`` command line, up to the script's own arguments."""
    argv = ["--nnodes", args.nnodes, "--nproc-per-node", str(args.nproc_per_node),
            "--max-restarts", str(args.max_restarts),
            "--monitor-interval", str(args.monitor_interval)]
    single_node = _parse_nnodes(args.nnodes)[1] == 1
    # Static rendezvous shares one store across restarts, and restarted workers can
    # read a dead attempt's addresses; a local c10d rendezvous gives each attempt
    # a fresh store (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, set in main).
    restartable = (args.rdzv_backend == "static" and single_node and args.max_restarts > 0
                   and args.master_port is None)
    if args.standalone or restartable:
        argv.append("--standalone")
    elif args.rdzv_backend == "static":
        port = args.master_port
        if port is None:
            port = free_port(args.master_addr) if _parse_nnodes(args.nnodes)[1] == 1 else 29500
        argv += ["--node-rank", str(args.node_rank), "--master-addr", args.master_addr,
                 "--master-port", str(port)]
    else:
        argv += ["--rdzv-backend", args.rdzv_backend, "--rdzv-endpoint", args.rdzv_endpoint,
                 "--rdzv-id", args.rdzv_id]
    # Bounded waits: torch's defaults let a node wait 10-15 minutes for missing peers.
    static = args.rdzv_backend == "static" and not (args.standalone or restartable)
    key = "timeout" if static else "join_timeout"
    conf = [c for c in args.rdzv_conf.split(",") if c]
    if not any(c.split("=")[0].strip() == key for c in conf):
        conf.append(f"{key}={max(1, round(args.join_timeout))}")
    argv += ["--rdzv-conf", ",".join(conf)]
    if args.local_addr:
        argv += ["--local-addr", args.local_addr]
    if args.module:
        argv.append("--module")
    if args.no_python:
        argv.append("--no-python")
    return [*argv, args.script]


def wait_for_master(host: str, port: int, timeout_s: float, *,
                    interval_s: float = DEFAULT_WAIT_REPORT_S, node_rank: int = 1) -> None:
    """Return once ``host:port`` accepts a TCP connection; LaunchError after ``timeout_s``.

    Node 0 may start later than the others, so a refused connection is retried;
    one line says so at the first refusal and every ``interval_s`` after it.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    next_notice = started
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.2, min(2.0, left))):
                return
        except OSError as exc:
            reason = exc.strerror or type(exc).__name__
        now = time.monotonic()
        if now + 0.5 >= deadline:
            raise LaunchError(
                f"master {host}:{port} is unreachable after {timeout_s:g} s ({reason}); start "
                "node 0 first, or check --master-addr/--master-port and the firewall "
                "(--join-timeout sets the wait)"
            )
        if now >= next_notice:
            print(f"paratrain launch: node {node_rank} is waiting for the master {host}:{port} "
                  f"(node 0) to start ({now - started:.0f} s so far, {reason}; fails in "
                  f"{deadline - now:.0f} s; --join-timeout sets the wait)",
                  file=sys.stderr, flush=True)
            next_notice += interval_s
        time.sleep(0.5)


def script_args(args: argparse.Namespace) -> list[str]:
    return args.script_args[1:] if args.script_args[:1] == ["--"] else list(args.script_args)


def _local_process_count(nproc: str) -> int:
    if nproc.isdigit():
        return int(nproc)
    import torch

    if nproc in ("auto", "gpu") and torch.cuda.is_available():
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def _launched_children() -> bool:
    """True once the agent has started worker processes (the rendezvous is over)."""
    try:
        return bool(psutil.Process().children())
    except psutil.Error:
        return False


def _rendezvous_notice(args: argparse.Namespace, high: int) -> Callable[[float], str]:
    if args.rdzv_backend == "static":
        who = f"node {args.node_rank} is waiting"
        where = f"{args.master_addr}:{args.master_port or 29500}"
    else:
        who, where = "this node is waiting", args.rdzv_endpoint
    missing = (f"the other {high - 1} node(s)" if args.rdzv_backend == "static"
               and args.node_rank == 0 else "all nodes")

    def line(elapsed: float) -> str:
        return (f"paratrain launch: {who} for {missing} of --nnodes {args.nnodes} to join at "
                f"{where} ({elapsed:.0f} s so far, fails in "
                f"{max(0.0, args.join_timeout - elapsed):.0f} s; --join-timeout sets the wait)")

    return line


def _stop_line(signum: int) -> str:
    if signum == signal.SIGINT:
        return "interrupted; workers were stopped"
    if signals.forwarded():  # the requeue signal came first: this is Slurm's requeue
        return (f"stopped by {signal.Signals(signum).name} after "
                f"{signal.Signals(signals.forwarded()[-1]).name} (the job is being requeued)")
    return f"stopped by {signal.Signals(signum).name}; workers were stopped"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``paratrain launch``; returns the process exit code."""
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before torch's agent handles SIGINT itself
        print(f"paratrain launch: {_stop_line(signal.SIGINT)}", file=sys.stderr)
        return 128 + signal.SIGINT


def _main(argv: Sequence[str] | None) -> int:
    parser, given = build_parser(), list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(given)
    try:  # a Kubeflow pod's PET_* / WORLD_SIZE+RANK fill the flags not given
        if (code := fault_tolerant.launch(args, given)) is not None:
            return code  # the lighthouse and a launch per replica group, all ended
        for notice in kubernetes.apply(args, kubernetes.explicit_options(parser, given),
                                       kubernetes.detect(os.environ)):
            print(f"paratrain launch: {notice}", file=sys.stderr, flush=True)
        for notice in slurm.apply(args, kubernetes.explicit_options(parser, given),
                                  slurm.detect(os.environ)):  # likewise Slurm's SLURM_*
            print(f"paratrain launch: {notice}", file=sys.stderr, flush=True)
        validate(args)
        misplaced = misplaced_flags_notice(args, given)
        if misplaced:
            print(f"paratrain launch: {misplaced}", file=sys.stderr, flush=True)
        interval = Settings.from_environ().wait_report_s
        signals.forward_to_children(Settings.from_environ().requeue_signal)  # Slurm's USR1
        wait = functools.partial(wait_for_master, interval_s=interval, node_rank=args.node_rank)
        if args.check or not args.no_check:
            high = _parse_nnodes(args.nnodes)[1]
            # Node 0 waits for the others' check-in: said every interval, as a rendezvous.
            with (waits.reporting(_rendezvous_notice(args, high), interval_s=interval)
                  if high > 1 and args.node_rank == 0 else contextlib.nullcontext()):
                passed = preflight.run(args, _local_process_count(str(args.nproc_per_node)),
                                       environ=os.environ, wait_for_master=wait)
            if args.check:
                print(f"paratrain launch: {passed}", flush=True)
                return 0
        elif (args.rdzv_backend == "static" and not args.standalone and args.node_rank > 0):
            wait(args.master_addr, args.master_port or 29500, args.join_timeout)
    except preflight.PreflightError as exc:
        print("\n".join(f"paratrain launch: {line}" for line in exc.lines), file=sys.stderr)
        return 2
    except (LaunchError, ValueError) as exc:
        print(f"paratrain launch: {exc}", file=sys.stderr)
        return 2
    if args.max_restarts > 0:
        # Restarted workers otherwise may reuse the agent's store address of a dead
        # attempt and fail to rendezvous (pytorch/pytorch#135712). Without restarts the
        # workers keep torchrun's default, the agent's store: with their own, rank 0
        # hosts it, and rank 0 still aborted at exit now and then (docs/reliability.md).
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    # Without this, every process would start one thread per core and they would
    # fight over the same cores.
    threads = cpu_threads_per_process(_local_process_count(str(args.nproc_per_node)))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    if args.ps_servers is not None:
        os.environ["PARATRAIN_PS_SERVERS"] = str(args.ps_servers)
    if args.parallel is not None:
        os.environ["PARATRAIN_PARALLEL"] = args.parallel
    if args.share_gpus:
        os.environ["PARATRAIN_SHARE_GPUS"] = "1"  # read by Topology.from_env in each worker

    from torch.distributed import DistNetworkError, DistStoreError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import get_args_parser, run

    torch_args = get_args_parser().parse_args(torchrun_argv(args))
    # Set directly: parsing them would let torchrun match the script's flags as its own.
    torch_args.training_script_args = script_args(args)
    # Workers leave their errors to the launcher's report, except when the job may
    # restart: then the error of an attempt that was retried would not be seen at all.
    quiet_workers = not args.no_python and args.max_restarts == 0
    if quiet_workers:
        os.environ[signals.ENV_LAUNCHED] = "1"
    if not args.no_python:
        # Workers run the script through paratrain's runner (clean exit, see launch_worker).
        torch_args.training_script_args = [
            "--module" if args.module else "--script", args.script,
            *torch_args.training_script_args]
        torch_args.training_script = launch_worker.__file__
        torch_args.module = False
    launch_report.quiet_agent_logs()
    high = _parse_nnodes(args.nnodes)[1]
    notice = waits.reporting(_rendezvous_notice(args, high), interval_s=interval,
                             done=_launched_children) if high > 1 else contextlib.nullcontext()
    try:
        with notice:
            run(torch_args)
    except ChildFailedError as exc:
        stack, line = launch_report.describe_failure(exc)
        if stack and quiet_workers:
            print(stack, file=sys.stderr)
        print(f"paratrain launch: {line}", file=sys.stderr)
        return 1
    except SignalException as exc:
        # The agent has already forwarded the signal to the workers and waited for them.
        print(f"paratrain launch: {_stop_line(exc.sigval)}", file=sys.stderr)
        return 128 + int(exc.sigval)
    except (DistStoreError, DistNetworkError, RendezvousError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"paratrain launch: the {high} nodes of --nnodes {args.nnodes} did not all join "
              f"within {args.join_timeout:g} s ({detail[:200]}); start every node with the "
              "same --nnodes, --master-addr and --master-port (or --rdzv-endpoint), or check "
              "the network (--join-timeout sets the wait)", file=sys.stderr)
        return 1
    return 0
