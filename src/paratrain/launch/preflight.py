"""The pre-flight check of ``paratrain launch``: before any worker starts, each node says
what it is about to start, and a node that disagrees is named in one line.

Each node builds a :class:`NodeView` (node rank, host, ``--nnodes``, processes per node,
torch and paratrain versions) and checks what it can alone: the interface named by
``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` exists here, and ``--nnodes`` /
``--node-rank`` agree with what Slurm or Kubernetes set (:func:`scheduler_problems`). On a
multi-node job with static rendezvous the nodes then meet in a ``torch.distributed.TCPStore``
on ``--master-port`` (served by node 0, closed before torchrun opens its own there;
:mod:`paratrain.launch.checkin`): node 0 gathers every view, compares them
(:func:`compare`) and hands every node the verdict, so all of them stop, or all go on.
Nodes that never check in are named after ``--join-timeout``.

It runs before every launch (``--no-check`` skips it; it costs a few milliseconds once the
nodes are up); ``paratrain launch --check ...`` runs only the check and prints a report.
Elastic (c10d) jobs get the checks one node can do alone: their nodes are numbered only at
rendezvous.

Example::

    >>> a = NodeView(0, "n0", "10.0.0.1", "2", 1, "2.5.0", "0.1.0")
    >>> b = NodeView(1, "n1", "10.0.0.2", "2", 2, "2.5.0", "0.1.0")
    >>> compare([a, b])[0].split(";")[0]
    'node 1 (n1 10.0.0.2) has --nproc-per-node 2, expected 1 as on node 0 (world size 3, not 2)'
"""

from __future__ import annotations

import argparse
import socket
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from importlib import metadata

from paratrain.launch import checkin, kubernetes

__all__ = ["NodeView", "PreflightError", "add_arguments", "compare", "run", "scheduler_problems"]

IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
DEFAULT_PORT = 29500  # as the launcher's for multi-node jobs


class PreflightError(RuntimeError):
    """The check failed; ``lines`` holds one line per problem (no line breaks inside)."""

    def __init__(self, lines: list[str]) -> None:
        super().__init__(" | ".join(lines))
        self.lines = lines


@dataclass(frozen=True)
class NodeView:
    """What one node is about to start, and what it found wrong on its own."""

    node_rank: int
    host: str
    addr: str  # this node's address towards node 0 (hostnames may repeat, e.g. in pods)
    nnodes: str
    nproc_per_node: int
    torch: str
    paratrain: str
    problems: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        return f"node {self.node_rank} ({' '.join(p for p in (self.host, self.addr) if p)})"

    @classmethod
    def from_dict(cls, data: Mapping) -> NodeView:
        """The view from its JSON form (``dataclasses.asdict``)."""
        return cls(**{**data, "problems": tuple(data.get("problems", ()))})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--check`` and ``--no-check`` on the launcher's parser."""
    parser.add_argument("--check", action="store_true",
                        help="run only the pre-flight check on this node and report")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the pre-flight check before starting workers")


def _high(nnodes: str) -> int:
    return int(nnodes.split(":")[-1])


def _holders(views: list[NodeView]) -> str:
    ranks = [str(v.node_rank) for v in views]
    if len(ranks) == 1:
        return f"node {ranks[0]}"
    shown = ", ".join(ranks[:4]) + (f" and {len(ranks) - 4} more" if len(ranks) > 4 else "")
    return f"nodes {shown}"


# attribute -> (how a value reads, the fix given the expected value)
FIELDS: dict[str, tuple[str, str]] = {
    "nnodes": ("--nnodes {}", "start every node with --nnodes {}"),
    "nproc_per_node": ("--nproc-per-node {}", "start every node with --nproc-per-node {}"),
    "torch": ("torch {}", "install torch {} on every node (one image or environment for all)"),
    "paratrain": ("paratrain {}", "install paratrain {} on every node"),
}


def compare(views: list[NodeView]) -> list[str]:
    """One line per problem among the nodes' views (empty when they agree).

    The expected value of a field is the one most nodes have (ties: node 0's side), so
    that with three nodes the odd one is named, not the two that agree.
    """
    views = sorted(views, key=lambda v: v.node_rank)
    lines = [f"{v.name}: {problem}" for v in views for problem in v.problems]
    by_rank: dict[int, list[NodeView]] = defaultdict(list)
    for view in views:
        by_rank[view.node_rank].append(view)
    for rank, same in by_rank.items():
        if len(same) > 1:
            every = "both" if len(same) == 2 else "all"
            lines.append(f"{' and '.join(v.name for v in same)} {every} have --node-rank {rank}; "
                         f"give each node its own --node-rank")
    for attr, (shown, fix) in FIELDS.items():
        counts = Counter(getattr(v, attr) for v in views)
        first = {getattr(v, attr): i for i, v in reversed(list(enumerate(views)))}
        expected = max(counts, key=lambda value: (counts[value], -first[value]))
        holders = _holders([v for v in views if getattr(v, attr) == expected])
        for view in views:
            value = getattr(view, attr)
            if value == expected:
                continue
            extra = ""
            if attr == "nproc_per_node":
                total = sum(v.nproc_per_node for v in views)
                extra = f" (world size {total}, not {len(views) * expected})"
            lines.append(f"{view.name} has {shown.format(value)}, expected {expected} as on "
                         f"{holders}{extra}; {fix.format(expected)}")
    return lines


def interface_problems(environ: Mapping[str, str], have: list[str]) -> list[str]:
    """Lines for interfaces named by ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` that
    this node lacks (``have``: its interface names). NCCL's ``^name`` (exclude) names
    nothing to look for; its plain names are prefixes, ``=name`` exact."""
    lines = []
    for variable in IFNAME_VARIABLES:
        value = environ.get(variable, "").strip()
        if not value or value.startswith("^"):
            continue
        nccl = variable.startswith("NCCL")
        exact = not nccl or value.startswith("=")
        wanted = [n.strip() for n in value.lstrip("=").split(",") if n.strip()]
        missing = [n for n in wanted
                   if not any(h == n or (not exact and h.startswith(n)) for h in have)]
        if missing:
            lines.append(f"{variable}={value}, but this node has no interface "
                         f"{', '.join(missing)} (it has {', '.join(have) or 'none'}); set "
                         f"{variable} to the interface this node reaches the others on")
    return lines


def scheduler_problems(nnodes: str, node_rank: int, environ: Mapping[str, str]) -> list[str]:
    """Lines where ``--nnodes`` / ``--node-rank`` contradict Slurm's step or the Kubernetes
    job: such a job cannot form (too many or too few nodes, or two nodes with one rank)."""
    lines = []
    if environ.get("SLURM_STEP_NUM_NODES", "").isdigit():  # inside an srun step
        nodes = int(environ["SLURM_STEP_NUM_NODES"])
        if ":" not in nnodes and int(nnodes) != nodes:
            lines.append(f"--nnodes is {nnodes} but Slurm runs this step on {nodes} node(s) "
                         f"(SLURM_STEP_NUM_NODES={nodes}); pass --nnodes {nodes}, or ask Slurm "
                         f"for {nnodes} nodes")
        nodeid = environ.get("SLURM_NODEID", "")
        if nodeid.isdigit() and int(nodeid) != node_rank:
            lines.append(f"--node-rank is {node_rank} but Slurm numbers this node {nodeid} "
                         f"(SLURM_NODEID={nodeid}); pass --node-rank $SLURM_NODEID")
    pod = kubernetes.detect(environ)
    if "nnodes" in pod.values and str(pod.values["nnodes"]) != nnodes:
        lines.append(f"--nnodes is {nnodes} but the Kubernetes job has {pod.values['nnodes']} "
                     f"node(s) ({pod.sources['nnodes']}); drop --nnodes to use the job's")
    if "node_rank" in pod.values and pod.values["node_rank"] != node_rank:
        lines.append(f"--node-rank is {node_rank} but this pod is node {pod.values['node_rank']} "
                     f"({pod.sources['node_rank']}); drop --node-rank to use the pod's")
    return lines


def _versions() -> tuple[str, str]:
    import torch

    try:
        ours = metadata.version("paratrain")
    except metadata.PackageNotFoundError:  # running from a source tree
        ours = "unknown"
    return torch.__version__, ours


def _resolve(host: str, port: int, deadline: float, name: str, timeout_s: float) -> None:
    """Return once ``host`` resolves; a node may start before the name exists (pods)."""
    while True:
        try:
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            return
        except OSError as exc:
            if time.monotonic() + 1.0 >= deadline:
                raise PreflightError([
                    f"{name} cannot resolve --master-addr {host} ({exc.strerror or exc}) within "
                    f"{timeout_s:g} s; use node 0's IP address or a name this node resolves "
                    "(--join-timeout sets the wait)"]) from None
        time.sleep(1.0)


def _address_towards(host: str, port: int) -> str:
    """This node's source address for packets to ``host`` (a UDP connect sends nothing)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((host, port))
            return sock.getsockname()[0]
    except OSError:
        return ""


def run(args: argparse.Namespace, nproc: int, *, environ: Mapping[str, str],
        wait_for_master: Callable[[str, int, float], None]) -> str:
    """Run the check for this node; return the one-line report, raise :class:`PreflightError`.

    ``nproc`` is this node's process count (``--nproc-per-node`` resolved);
    ``wait_for_master(host, port, timeout_s)`` returns once node 0's port accepts
    connections (the launcher's, which prints waiting notices and fails in one line).
    """
    started = time.monotonic()
    deadline = started + args.join_timeout
    torch_version, our_version = _versions()
    high = _high(args.nnodes)
    exchange = (args.rdzv_backend == "static" and not args.standalone and high > 1)
    port = args.master_port or DEFAULT_PORT
    host = socket.gethostname()
    problems = [*interface_problems(environ, [n for _, n in socket.if_nameindex()]),
                *scheduler_problems(args.nnodes, args.node_rank, environ)]
    view = NodeView(args.node_rank, host, "", args.nnodes, nproc, torch_version, our_version,
                    tuple(problems))
    if exchange and args.node_rank > 0:
        _resolve(args.master_addr, port, deadline, view.name, args.join_timeout)
        wait_for_master(args.master_addr, port, max(1, round(deadline - time.monotonic())))
        view = replace(view, addr=_address_towards(args.master_addr, port))
    elif exchange:
        view = replace(view, addr=args.master_addr)
    if not exchange:
        if problems:
            raise PreflightError(compare([view]))
        return (f"pre-flight passed on {view.name}: {nproc} process(es), torch {torch_version}, "
                f"paratrain {our_version} (cross-node checks need --nnodes > 1 with static "
                "rendezvous)")
    found, lines = checkin.exchange(
        asdict(view), name=view.name, master_addr=args.master_addr, port=port,
        expected_nodes=high, deadline=deadline, timeout_s=args.join_timeout,
        judge=lambda views: compare([NodeView.from_dict(v) for v in views]))
    if lines:
        raise PreflightError(lines)
    world = sum(v["nproc_per_node"] for v in found)
    return (f"pre-flight passed on {view.name}: {len(found)} node(s) x {nproc} process(es) = "
            f"world size {world}; torch {torch_version} and paratrain {our_version} on every "
            f"node; node 0 at {args.master_addr}:{port} reachable")
