"""The pre-flight check: comparing views, local checks, the TCPStore meeting on loopback,
and `paratrain launch --check` on one node. (Several hosts: tests/multinode/.)"""

import socket
import subprocess
import sys
import threading
import time
from dataclasses import asdict

import pytest

from paratrain.launch import checkin, preflight
from paratrain.launch.preflight import NodeView, compare


def view(rank, nproc=1, nnodes="2", torch="2.5.0", ours="0.1.0", problems=()):
    return NodeView(rank, f"h{rank}", f"10.0.0.{rank + 1}", nnodes, nproc, torch, ours, problems)


def test_agreeing_nodes_give_no_line():
    assert compare([view(0), view(1)]) == []


def test_other_process_count_names_the_node_the_values_and_the_fix():
    assert compare([view(0), view(1, nproc=2)]) == [
        "node 1 (h1 10.0.0.2) has --nproc-per-node 2, expected 1 as on node 0 (world size 3, "
        "not 2); start every node with --nproc-per-node 1"]


def test_the_odd_node_is_named_even_when_it_is_node_0():
    lines = compare([view(0, nnodes="3", nproc=4), view(1, nnodes="3"), view(2, nnodes="3")])
    assert lines == ["node 0 (h0 10.0.0.1) has --nproc-per-node 4, expected 1 as on nodes 1, 2 "
                     "(world size 6, not 3); start every node with --nproc-per-node 1"]


def test_versions_and_node_count_are_compared():
    lines = compare([view(0), view(1, nnodes="3", torch="2.4.1", ours="0.0.9")])
    assert [line.split(";")[0] for line in lines] == [
        "node 1 (h1 10.0.0.2) has --nnodes 3, expected 2 as on node 0",
        "node 1 (h1 10.0.0.2) has torch 2.4.1, expected 2.5.0 as on node 0",
        "node 1 (h1 10.0.0.2) has paratrain 0.0.9, expected 0.1.0 as on node 0"]


def test_two_nodes_with_one_rank_and_local_problems_are_named():
    lines = compare([view(0), view(1, problems=("GLOO_SOCKET_IFNAME=x, but ...",)), view(1)])
    assert lines == [
        "node 1 (h1 10.0.0.2): GLOO_SOCKET_IFNAME=x, but ...",
        "node 1 (h1 10.0.0.2) and node 1 (h1 10.0.0.2) both have --node-rank 1; give each node "
        "its own --node-rank"]


@pytest.mark.parametrize("environ, missing", [
    ({"GLOO_SOCKET_IFNAME": "eth0"}, None),
    ({"GLOO_SOCKET_IFNAME": "eth9"}, "GLOO_SOCKET_IFNAME=eth9, but this node has no interface eth9"),
    ({"GLOO_SOCKET_IFNAME": "eth0,ib0"}, "no interface ib0 (it has lo, eth0)"),
    ({"GLOO_SOCKET_IFNAME": "eth"}, "no interface eth "),  # gloo wants exact names
    ({"NCCL_SOCKET_IFNAME": "eth"}, None),  # NCCL: a prefix
    ({"NCCL_SOCKET_IFNAME": "=eth"}, "NCCL_SOCKET_IFNAME==eth, but this node has no interface"),
    ({"NCCL_SOCKET_IFNAME": "^docker"}, None),  # an exclusion names nothing to find
    ({}, None),
])
def test_interface_names_are_looked_up_on_this_node(environ, missing):
    lines = preflight.interface_problems(environ, ["lo", "eth0"])
    assert (lines == []) if missing is None else (len(lines) == 1 and missing in lines[0])


def test_slurm_and_kubernetes_counts_must_match_the_flags():
    slurm = {"SLURM_STEP_NUM_NODES": "3", "SLURM_NODEID": "2"}
    assert preflight.scheduler_problems("3", 2, slurm) == []
    assert preflight.scheduler_problems("2", 1, slurm) == [
        "--nnodes is 2 but Slurm runs this step on 3 node(s) (SLURM_STEP_NUM_NODES=3); pass "
        "--nnodes 3, or ask Slurm for 2 nodes",
        "--node-rank is 1 but Slurm numbers this node 2 (SLURM_NODEID=2); pass --node-rank "
        "$SLURM_NODEID"]
    pod = {"PET_NNODES": "2", "PET_NODE_RANK": "1"}
    assert preflight.scheduler_problems("2", 1, pod) == []
    assert preflight.scheduler_problems("4", 0, pod) == [
        "--nnodes is 4 but the Kubernetes job has 2 node(s) (PET_NNODES=2); drop --nnodes to "
        "use the job's",
        "--node-rank is 0 but this pod is node 1 (PET_NODE_RANK=1); drop --node-rank to use "
        "the pod's"]


# -- the meeting, through a real TCPStore on loopback ------------------------------------

def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def meet(views, port, expected=2, timeout_s=10.0):
    """Run exchange for each view in its own thread (node 0 first); rank -> (views, lines)."""
    results = {}

    def node(v):
        results[v.node_rank] = checkin.exchange(
            asdict(v), name=v.name, master_addr="127.0.0.1", port=port,
            expected_nodes=expected, deadline=time.monotonic() + timeout_s, timeout_s=timeout_s,
            judge=lambda found: compare([NodeView.from_dict(d) for d in found]))

    threads = [threading.Thread(target=node, args=(v,)) for v in views]
    for t in threads:
        t.start()
        time.sleep(0.2)  # the server first, as wait_for_master ensures in the launcher
    for t in threads:
        t.join(timeout_s + 30)
    return results


def test_every_node_gets_node_0s_verdict_through_the_store():
    results = meet([view(0), view(1, nproc=2)], free_port())
    assert results[0][1] == results[1][1] == compare([view(0), view(1, nproc=2)])
    assert sorted(v["node_rank"] for v in results[1][0]) == [0, 1]
    ok = meet([view(0), view(1)], free_port())
    assert ok[0][1] == ok[1][1] == []


def test_nodes_that_never_check_in_are_named_after_the_timeout():
    port = free_port()
    started = time.monotonic()
    results = meet([view(0, nnodes="3"), view(1, nnodes="3")], port, expected=3, timeout_s=1.5)
    assert time.monotonic() - started < 10
    line = (f"node(s) 2 of --nnodes 3 did not check in within 1.5 s (node 0 waited at "
            f"127.0.0.1:{port}); start them with the same --master-addr and --master-port, or "
            "look at their logs (--join-timeout sets the wait)")
    assert results[0][1] == results[1][1] == [line]


def test_a_taken_port_is_one_line_on_node_0():
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))
        busy.listen()
        port = busy.getsockname()[1]
        results = meet([view(0)], port)
    assert results[0][1][0].startswith(f"node 0 (h0 10.0.0.1) cannot listen on --master-port "
                                       f"{port} (")
    assert results[0][1][0].endswith("pick another --master-port, or stop what uses it")


def test_a_node_0_without_the_check_or_without_a_verdict_is_one_line_not_a_hang():
    from datetime import timedelta

    from torch.distributed import TCPStore

    port = free_port()
    server = TCPStore("127.0.0.1", port, None, True, timedelta(seconds=5),
                      wait_for_workers=False)  # node 0 started with --no-check: torchrun's store
    started = time.monotonic()
    results = meet([view(1)], port, timeout_s=1.0)
    assert results[1][1] == [
        f"node 1 (h1 10.0.0.2) found no pre-flight check at node 0's 127.0.0.1:{port} (node 0 "
        "runs with --no-check, or another job holds the port); start every node alike, with "
        "or without --no-check"]
    server.set(checkin.PREFIX + "open", "1")  # a node 0 that checks, but never answers
    checkin.VERDICT_GRACE_S, grace = 0.0, checkin.VERDICT_GRACE_S
    try:
        results = meet([view(1)], port, timeout_s=1.0)
    finally:
        checkin.VERDICT_GRACE_S = grace
    assert results[1][1] == [
        f"node 1 (h1 10.0.0.2) got no pre-flight answer from node 0 at 127.0.0.1:{port} within "
        "1 s; look at node 0's log (--join-timeout sets the wait)"]
    assert time.monotonic() - started < 15


# -- through the command line ------------------------------------------------------------

def launch(*argv, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "paratrain.cli", "launch", *argv],
                          capture_output=True, text=True, timeout=timeout, env=env)


def test_check_reports_and_starts_no_worker(tmp_path):
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    result = launch("--check", "--nproc-per-node", "2", str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("paratrain launch: pre-flight passed on node 0 (")
    assert ": 2 process(es), torch " in result.stdout
    assert not (tmp_path / "ran").exists()


def test_missing_interface_stops_the_launch_in_one_line(tmp_path):
    import os

    script = tmp_path / "touch.py"
    script.write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    result = launch(str(script), env={**os.environ, "GLOO_SOCKET_IFNAME": "nosuch0"})
    assert result.returncode == 2
    [line] = result.stderr.strip().splitlines()
    assert line.startswith(f"paratrain launch: node 0 ({socket.gethostname()}): "
                           "GLOO_SOCKET_IFNAME=nosuch0, but this node has no interface nosuch0")
    assert not (tmp_path / "ran").exists()
    skipped = launch("--no-check", str(script),
                     env={**os.environ, "GLOO_SOCKET_IFNAME": "nosuch0"})
    assert skipped.returncode == 0 and (tmp_path / "ran").exists()


def test_a_master_name_that_does_not_resolve_is_one_line_within_the_timeout():
    from paratrain.launch.launcher import build_parser

    args = build_parser().parse_args(["--nnodes", "2", "--node-rank", "1", "--master-addr",
                                      "no-such-host.invalid", "--join-timeout", "1", __file__])

    def never(*_):
        raise AssertionError("the port is probed only once the name resolves")

    started = time.monotonic()
    with pytest.raises(preflight.PreflightError) as info:
        preflight.run(args, 1, environ={}, wait_for_master=never)
    [line] = info.value.lines
    assert line.startswith(f"node 1 ({socket.gethostname()}) cannot resolve --master-addr "
                           "no-such-host.invalid (")
    assert line.endswith(") within 1 s; use node 0's IP address or a name this node resolves "
                         "(--join-timeout sets the wait)")
    assert time.monotonic() - started < 30  # one lookup; a slow resolver may take a while
