"""Real multi-node runs: `paratrain launch --nnodes 2` on two network-namespace hosts.

* The demo on 2 hosts x 1 process ends with the same parameters as on
  1 host x 2 processes, with static and with c10d rendezvous.
* A host whose link is cut: both sides exit within the collective timeout plus
  a few seconds, each naming the rank and host it lost.

Needs root and iproute2 (skipped otherwise). Traffic stays on the hosts'
own addresses (a /24 that exists only inside the namespaces) and loopback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from paratrain.datasets.images import DatasetNotFound, find_fashion_mnist
from paratrain.testing import netns

_OK, _REASON = netns.netns_available()
pytestmark = [
    pytest.mark.multinode,
    pytest.mark.slow,
    pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_REASON}"),
]

PORT = 29500  # every namespace has its own port space
TRAIN = str(Path(__file__).resolve().parents[1] / "scripts" / "fault_train.py")
CLI = [sys.executable, "-m", "paratrain.cli", "launch"]
TIMEOUT_S = 10  # collective timeout of the link-cut test
# Ending "without a hang": the collective's timeout, the hang report's own wait for its
# peers (at most one more timeout) and the launcher's teardown, with room for a loaded
# 2-core CI machine (26.6 s seen there); a hang runs to gloo's 30-minute default.
HANG_S = 5 * TIMEOUT_S
ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def have_data() -> bool:
    try:
        find_fashion_mnist()
        return True
    except DatasetNotFound:
        return False


DEMO = ["-m", "paratrain.demo", "--epochs", "1", "--train-samples", "384",
        "--test-samples", "256", "--batch-size", "32", "--no-progress"]


@pytest.fixture
def cluster():
    netns.cleanup_stale()
    with netns.NetnsCluster(num_hosts=2) as c:
        yield c


def node_argv(cluster: netns.NetnsCluster, k: int, mode: str) -> list[str]:
    master = cluster.hosts[0].addr
    argv = [*CLI, "--nnodes", "2", "--nproc-per-node", "1", "--join-timeout", "30"]
    if mode == "static":
        return [*argv, "--node-rank", str(k), "--master-addr", master,
                "--master-port", str(PORT)]
    argv += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{PORT}",
             "--rdzv-id", f"mn-{cluster.id}", "--local-addr", cluster.hosts[k].addr]
    # torch matches the endpoint against the hostname, which is loopback here.
    return [*argv, "--rdzv-conf", "is_host=1"] if k == 0 else argv


def start_nodes(cluster, mode, script_argv, logs, env=None):
    procs = []
    for k, host in enumerate(cluster.hosts):
        with open(logs[k], "w") as log:
            procs.append(host.popen([*node_argv(cluster, k, mode), *script_argv],
                                    env={**os.environ, **ENV, **(env or {})},
                                    stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_all(procs, timeout: float) -> float:
    """Seconds until every node exited; kills every process tree left after ``timeout``."""
    started = time.monotonic()
    while any(p.poll() is None for p in procs) and time.monotonic() - started < timeout:
        time.sleep(0.2)
    elapsed = time.monotonic() - started
    for p in procs:
        if p.poll() is None:
            netns.kill_process_tree(p, grace=2.0)
    return elapsed


def report(procs, logs) -> str:
    return "\n".join(f"--- node {k} (rc={p.returncode}) ---\n{log.read_text()[-3000:]}"
                     for k, (p, log) in enumerate(zip(procs, logs)))


@pytest.fixture(scope="module")
def one_host_params(tmp_path_factory) -> dict[str, torch.Tensor]:
    """1 host x 2 processes on loopback: the reference."""
    out = tmp_path_factory.mktemp("ref") / "params.pt"
    result = subprocess.run([*CLI, "--nproc-per-node", "2", *DEMO, "--save-params", str(out)],
                            capture_output=True, text=True, timeout=180, env={**os.environ, **ENV})
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(out)


@pytest.mark.skipif(not have_data(), reason="Fashion-MNIST missing: make data")
@pytest.mark.parametrize("mode", ["static", "c10d"])
def test_demo_on_two_hosts_matches_one_host(cluster, mode, tmp_path, one_host_params):
    out = tmp_path / "params.pt"
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    procs = start_nodes(cluster, mode, [*DEMO, "--save-params", str(out)], logs)
    wait_all(procs, timeout=180)
    assert [p.returncode for p in procs] == [0, 0], report(procs, logs)
    assert "training on 2 process(es)" in logs[0].read_text() + logs[1].read_text()
    got = torch.load(out)
    for name, expected in one_host_params.items():
        assert torch.equal(got[name], expected), name


def test_cut_link_ends_both_sides_naming_the_lost_host(cluster, tmp_path):
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    procs = start_nodes(cluster, "static",
                        [TRAIN, "--epochs", "100000", "--log-steps", "--step-sleep", "0.02"],
                        logs, env={"PARATRAIN_TIMEOUT_S": str(TIMEOUT_S)})
    try:
        deadline = time.monotonic() + 120
        while "step 5 " not in logs[1].read_text() and time.monotonic() < deadline:
            assert all(p.poll() is None for p in procs), report(procs, logs)
            time.sleep(0.2)
        assert "step 5 " in logs[1].read_text(), report(procs, logs)
        cluster.cut_link(1)
        cut_at = time.strftime("%H:%M:%S")
        elapsed = wait_all(procs, timeout=HANG_S)
    finally:
        wait_all(procs, timeout=0)
    text = f"link cut at {cut_at}\n" + report(procs, logs)
    assert all(p.returncode not in (None, 0) for p in procs), text
    assert elapsed < HANG_S, f"{elapsed:.1f} s\n{text}"
    h0, h1 = (h.addr for h in cluster.hosts)
    last = [log.read_text().strip().splitlines()[-1] for log in logs]
    assert f"lost rank 1 (host {h1})" in last[0], text
    assert f"lost contact with rank 0 (host {h0}" in last[1], text
