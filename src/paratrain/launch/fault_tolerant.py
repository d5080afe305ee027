"""``paratrain launch --fault-tolerant``: a torchft lighthouse and one torchrun per replica group.

Without ``--replica-group``, this launcher starts the lighthouse (torchft's
``LighthouseServer``, unless ``--lighthouse`` names a running one) and then each of the
``--replica-groups`` groups as its own ``paratrain launch`` (its own ``torch.distributed.run``
and rendezvous, restarted on its own with ``--max-restarts``), the same command line with
``PARATRAIN_REPLICA_GROUP=G/R`` and ``PARATRAIN_LIGHTHOUSE`` set; it waits for all of them.
A group that dies leaves the quorum and the others keep training; restarted by its torchrun,
it heals from a live peer. With ``--replica-group G`` (one group per node, the lighthouse
started elsewhere), only that group runs here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from paratrain.fault_tolerance.options import LIGHTHOUSE_HEARTBEAT_S, LIGHTHOUSE_JOIN_S
from paratrain.settings import Settings

__all__ = ["add_arguments", "launch"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's fault-tolerance flags."""
    group = parser.add_argument_group("fault tolerance (torchft; docs/reliability.md)")
    add = group.add_argument
    add("--fault-tolerant", action="store_true",
        help="replica groups that keep training when one dies; a restarted group heals "
             "from a live peer (needs torchft)")
    add("--replica-groups", type=int, default=None,
        help="number of replica groups, each --nproc-per-node processes (with --fault-tolerant)")
    add("--replica-group", type=int, default=None,
        help="run only this group here (one launch per group; needs --lighthouse)")
    add("--lighthouse", default=None,
        help="address of a running lighthouse, http://HOST:PORT (default: start one here)")
    add("--min-groups", type=int, default=1,
        help="fewest groups a step may commit with (the lighthouse's quorum size)")


def _check(args: argparse.Namespace) -> None:
    given = [f for f, v in (("--replica-groups", args.replica_groups),
                            ("--replica-group", args.replica_group),
                            ("--lighthouse", args.lighthouse)) if v is not None]
    if not args.fault_tolerant:
        if given:
            raise ValueError(f"{given[0]} needs --fault-tolerant")
        return
    if args.replica_groups is None or args.replica_groups < 1:
        raise ValueError("--fault-tolerant needs --replica-groups R (R >= 1 replica groups)")
    if args.min_groups < 1 or args.min_groups > args.replica_groups:
        raise ValueError(f"--min-groups must be between 1 and --replica-groups "
                         f"({args.replica_groups}), got {args.min_groups}")
    if args.replica_group is not None:
        if not 0 <= args.replica_group < args.replica_groups:
            raise ValueError(f"--replica-group must be in [0, {args.replica_groups}), got "
                             f"{args.replica_group}")
        if args.lighthouse is None:
            raise ValueError("--replica-group runs one group here; give the running "
                             "lighthouse's address with --lighthouse http://HOST:PORT")
    if args.lighthouse is not None and not args.lighthouse.startswith(("http://", "https://")):
        raise ValueError(f"--lighthouse must be http://HOST:PORT, got {args.lighthouse!r}")


@contextlib.contextmanager
def _lighthouse(args: argparse.Namespace) -> Iterator[str]:
    """The lighthouse's address for local groups: the one given, or one started here."""
    if args.lighthouse is not None:
        yield args.lighthouse
        return
    try:
        from torchft.coordination import LighthouseServer
    except ImportError:
        raise ValueError("--fault-tolerant needs torchft: pip install 'paratrain[ft]'") from None
    server = LighthouseServer(bind="[::]:0", min_replicas=args.min_groups,
                              join_timeout_ms=round(LIGHTHOUSE_JOIN_S * 1000),
                              heartbeat_timeout_ms=round(LIGHTHOUSE_HEARTBEAT_S * 1000))
    port = server.address().rsplit(":", 1)[1]
    print(f"paratrain launch: lighthouse at {server.address()} (other nodes: --lighthouse "
          f"http://<this host>:{port})", file=sys.stderr, flush=True)
    try:
        yield f"http://127.0.0.1:{port}"  # the groups started here are local
    finally:
        server.shutdown()


def _group_env(args: argparse.Namespace, group: int, lighthouse: str) -> dict[str, str]:
    return {"PARATRAIN_REPLICA_GROUP": f"{group}/{args.replica_groups}",
            "PARATRAIN_LIGHTHOUSE": lighthouse}


def launch(args: argparse.Namespace, argv: Sequence[str]) -> int | None:
    """Run a fault-tolerant launch. None: this process is one group's launcher (the
    variables are set; the caller launches as usual); else the exit code of all groups."""
    _check(args)
    if not args.fault_tolerant:
        return None
    # torchft logs every quorum and vote at INFO; paratrain says what changed, in one line.
    os.environ.setdefault("RUST_LOG", "warn")
    if args.replica_group is not None or Settings.from_environ().replica_group is not None:
        if args.replica_group is not None:
            os.environ.update(_group_env(args, args.replica_group, args.lighthouse))
        return None
    with _lighthouse(args) as lighthouse:
        groups = [subprocess.Popen([sys.executable, "-m", "paratrain.cli", "launch", *argv],
                                   env={**os.environ, **_group_env(args, g, lighthouse)})
                  for g in range(args.replica_groups)]
        return _wait(groups)


def _wait(groups: list[subprocess.Popen[Any]]) -> int:
    """Wait for every group; a signal to this launcher goes to all of them (no orphans)."""
    def forward(signum: int, _frame: Any) -> None:
        for proc in groups:
            if proc.poll() is None:
                proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        while any(proc.poll() is None for proc in groups):
            time.sleep(0.2)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    failed = [(g, proc.returncode) for g, proc in enumerate(groups) if proc.returncode != 0]
    if not failed:
        return 0
    names = ", ".join(f"group {g} (exit {code})" for g, code in failed)
    print(f"paratrain launch: replica {names} ended with an error; the other groups "
          f"{'finished' if len(failed) < len(groups) else 'failed too'}", file=sys.stderr)
    return 1
