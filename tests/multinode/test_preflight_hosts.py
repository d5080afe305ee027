"""The pre-flight check on network-namespace hosts: `paratrain launch --nnodes 2` where one
node was started differently stops on both nodes with the one line naming it; a
matching pair passes and trains; an unreachable master is one line within --join-timeout.

Needs root and iproute2 (skipped otherwise), as tests/multinode/test_multinode.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from paratrain.testing import netns

_OK, _REASON = netns.netns_available()
pytestmark = [
    pytest.mark.multinode,
    pytest.mark.slow,
    pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_REASON}"),
]

PORT = 29500
CHECK = str(Path(__file__).resolve().parents[1] / "netns_scripts" / "allreduce_check.py")
CLI = [sys.executable, "-m", "paratrain.cli", "launch"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
JOIN_S = 20


@pytest.fixture
def cluster():
    netns.cleanup_stale()
    with netns.NetnsCluster(num_hosts=2) as c:
        yield c


def run_nodes(cluster, flags=((), ()), prefix=((), ()), ranks=(0, 1), join_s=JOIN_S):
    """Start node k of ``ranks`` with its ``flags[k]`` (``prefix[k]`` before the command);
    return (return codes, outputs without torch's netns-only reverse-DNS warnings), seconds."""
    master = cluster.hosts[0].addr
    procs = []
    for k in ranks:
        argv = [*prefix[k], *CLI, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
                str(k), "--master-addr", master, "--master-port", str(PORT), "--join-timeout",
                str(join_s), *flags[k], CHECK]
        procs.append(cluster.hosts[k].popen(argv, env=ENV, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, text=True))
    started = time.monotonic()
    outs = [p.communicate(timeout=join_s + 120)[0] for p in procs]
    elapsed = time.monotonic() - started
    outs = ["\n".join(line for line in out.splitlines() if "socket.cpp" not in line)
            for out in outs]
    return [p.returncode for p in procs], outs, elapsed


def paratrain_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("paratrain launch: node ")
            and "is waiting for the master" not in line]


def test_matching_nodes_pass_the_check_and_train(cluster):
    codes, outs, _ = run_nodes(cluster)
    assert codes == [0, 0], outs
    assert all("allreduce ok" in out and "world=2" in out for out in outs), outs


def test_check_only_reports_on_every_node(cluster):
    codes, outs, _ = run_nodes(cluster, flags=(["--check"], ["--check"]))
    assert codes == [0, 0], outs
    h0, h1 = (h.addr for h in cluster.hosts)
    for k, addr in enumerate((h0, h1)):
        assert f"paratrain launch: pre-flight passed on node {k} (" in outs[k], outs
        assert f"{addr}): 2 node(s) x 1 process(es) = world size 2;" in outs[k], outs
        assert "allreduce ok" not in outs[k]


def test_other_process_count_is_one_line_naming_the_node_on_both(cluster):
    codes, outs, elapsed = run_nodes(cluster, flags=((), ["--nproc-per-node", "2"]))
    assert codes == [2, 2], outs
    h1 = cluster.hosts[1].addr
    expected = ("has --nproc-per-node 2, expected 1 as on node 0 (world size 3, not 2); start "
                "every node with --nproc-per-node 1")
    for out in outs:
        [line] = paratrain_lines(out)
        assert line.startswith("paratrain launch: node 1 (") and f" {h1}) " in line, out
        assert line.endswith(expected), out
    assert elapsed < JOIN_S, outs  # decided when both checked in, not at the timeout


def test_missing_interface_on_one_node_is_named(cluster):
    codes, outs, _ = run_nodes(cluster, prefix=((), ["env", "GLOO_SOCKET_IFNAME=nosuch0"]))
    assert codes == [2, 2], outs
    iface = cluster.hosts[1].ifname
    for out in outs:
        [line] = paratrain_lines(out)
        assert line.startswith("paratrain launch: node 1 ("), out
        assert line.endswith(f"GLOO_SOCKET_IFNAME=nosuch0, but this node has no interface "
                             f"nosuch0 (it has lo, {iface}); set GLOO_SOCKET_IFNAME to the "
                             "interface this node reaches the others on"), out


def test_unreachable_master_port_is_one_line_within_the_join_timeout(cluster):
    codes, outs, elapsed = run_nodes(cluster, ranks=(1,), join_s=3)  # node 0 never starts
    assert codes == [2], outs
    last = outs[0].strip().splitlines()[-1]
    assert last == (f"paratrain launch: master {cluster.hosts[0].addr}:{PORT} is unreachable "
                    "after 3 s (Connection refused); start node 0 first, or check "
                    "--master-addr/--master-port and the firewall (--join-timeout sets the "
                    "wait)"), outs
    assert elapsed < 3 + 30, outs  # 30: starting Python and torch on a busy machine
