"""Real multi-node checks on network-namespace "hosts" (needs root and iproute2)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

try:
    from paratrain.testing import netns
except ImportError:  # package not installed: use the source tree
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from paratrain.testing import netns

_OK, _REASON = netns.netns_available()
pytestmark = [
    pytest.mark.multinode,
    pytest.mark.slow,
    pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_REASON}"),
]

SCRIPT = Path(__file__).resolve().parents[1] / "netns_scripts" / "allreduce_check.py"
PORT = 29500  # every namespace has its own port space, so a fixed port cannot collide
JOB_TIMEOUT = 90.0

SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen(8)
s.settimeout(float(sys.argv[3]))
print("listening", flush=True)
while True:
    c, _ = s.accept()
    c.sendall(b"ok")
    c.close()
"""

CLIENT = """
import socket, sys, time
addr, port, retry_for = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
deadline = time.monotonic() + retry_for
while True:
    try:
        with socket.create_connection((addr, port), timeout=1.5) as c:
            assert c.recv(2) == b"ok"
        print("connected", flush=True)
        sys.exit(0)
    except OSError as exc:
        if time.monotonic() >= deadline:
            print(f"connect failed: {exc!r}", flush=True)
            sys.exit(1)
        time.sleep(0.1)
"""


@pytest.fixture
def cluster():
    with netns.NetnsCluster(num_hosts=2) as c:
        yield c


def _server(host: netns.NetnsHost, lifetime: float = 30.0) -> subprocess.Popen:
    return host.popen(
        [sys.executable, "-c", SERVER, host.addr, str(PORT), str(lifetime)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _connect(host: netns.NetnsHost, addr: str, retry_for: float) -> subprocess.CompletedProcess:
    return host.run(
        [sys.executable, "-c", CLIENT, addr, str(PORT), str(retry_for)],
        timeout=retry_for + 15,
        capture_output=True,
        text=True,
    )


def test_hosts_can_connect_both_ways(cluster):
    h0, h1 = cluster.hosts
    assert h0.addr != h1.addr and h0.addr.rsplit(".", 1)[0] == h1.addr.rsplit(".", 1)[0]
    servers = [_server(h0), _server(h1)]
    try:
        for src, dst in ((h0, h1), (h1, h0)):
            res = _connect(src, dst.addr, retry_for=10)
            assert res.returncode == 0, res.stdout + res.stderr
    finally:
        for proc in servers:
            netns.kill_process_tree(proc, grace=1.0)


def _launch_args(mode: str, cluster: netns.NetnsCluster, k: int) -> list[str]:
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
            "--nproc-per-node", "1", "--max-restarts", "0"]
    master = cluster.hosts[0].addr
    if mode == "static":
        args += ["--node-rank", str(k), "--master-addr", master, "--master-port", str(PORT)]
    else:
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master}:{PORT}",
                 "--rdzv-id", f"netns-{cluster.id}", "--local-addr", cluster.hosts[k].addr]
        if k == 0:
            args += ["--rdzv-conf", "is_host=1"]
    return [*args, str(SCRIPT)]


@pytest.mark.parametrize("mode", ["static", "c10d"])
def test_two_node_allreduce(cluster, mode, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = [tmp_path / f"node{k}.log" for k in range(2)]
    procs = []
    try:
        for k, host in enumerate(cluster.hosts):
            with open(logs[k], "w") as log:
                procs.append(host.popen(_launch_args(mode, cluster, k), env=env,
                                        stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + JOB_TIMEOUT
        while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p in procs):
                break  # one node failed: do not wait for the other to time out
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                netns.kill_process_tree(p, grace=2.0)
    outputs = [log.read_text() for log in logs]
    report = "\n".join(f"--- node {k} (rc={p.returncode}) ---\n{out[-4000:]}"
                       for k, (p, out) in enumerate(zip(procs, outputs, strict=True)))
    assert [p.returncode for p in procs] == [0, 0], report
    for k, out in enumerate(outputs):
        assert f"allreduce ok rank={k} world=2 sum=3" in out, report


def test_cut_and_restore_link(cluster):
    h0, h1 = cluster.hosts
    server = _server(h1)
    try:
        res = _connect(h0, h1.addr, retry_for=10)
        assert res.returncode == 0, res.stdout + res.stderr
        cluster.cut_link(1)
        res = _connect(h0, h1.addr, retry_for=0)
        assert res.returncode == 1 and "connect failed" in res.stdout, res.stdout + res.stderr
        cluster.restore_link(1)
        res = _connect(h0, h1.addr, retry_for=10)
        assert res.returncode == 0, res.stdout + res.stderr
        # A timed cut restores itself in the background.
        cluster.cut_link(1, seconds=1.0)
        res = _connect(h0, h1.addr, retry_for=10)
        assert res.returncode == 0, res.stdout + res.stderr
    finally:
        netns.kill_process_tree(server, grace=1.0)


def test_limit_rate_installs_tbf(cluster):
    try:
        cluster.limit_rate(0, rate="200mbit")
    except netns.NetnsUnavailable as exc:
        pytest.skip(str(exc))
    host = cluster.hosts[0]
    shown = subprocess.run(["tc", "-n", host.netns, "qdisc", "show", "dev", host.ifname],
                           capture_output=True, text=True, timeout=10).stdout
    assert "tbf" in shown and "200Mbit" in shown, shown
    cluster.limit_rate(0, rate=None)
    shown = subprocess.run(["tc", "-n", host.netns, "qdisc", "show", "dev", host.ifname],
                           capture_output=True, text=True, timeout=10).stdout
    assert "tbf" not in shown, shown


def _netns_names() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=10).stdout


def test_teardown_removes_everything():
    c = netns.NetnsCluster(num_hosts=3)
    names = c.namespaces
    assert len(names) == 4 and all(c.id in n for n in names)
    listed = _netns_names()
    assert all(n in listed for n in names)
    sleeper = c.hosts[2].popen([sys.executable, "-c", "import time; time.sleep(60)"])
    c.close()
    assert sleeper.poll() is not None
    assert c.id not in _netns_names()


def test_teardown_on_exception():
    with pytest.raises(KeyboardInterrupt):
        with netns.NetnsCluster(num_hosts=2) as c:
            ident = c.id
            raise KeyboardInterrupt
    assert ident not in _netns_names()


def test_cleanup_stale_only_removes_dead_owners():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = f"{netns.PREFIX}deadbe-{dead.pid}-h0"
    subprocess.run(["ip", "netns", "add", stale], check=True, timeout=10)
    with netns.NetnsCluster(num_hosts=1) as live:
        removed = netns.cleanup_stale(older_than=time.time() + 1)
        assert stale in removed
        assert not any(live.id in n for n in removed)
        assert all(n in _netns_names() for n in live.namespaces)
    assert stale not in _netns_names()


def test_interrupt_during_setup_leaks_nothing(monkeypatch):
    real_cmd, calls = netns._cmd, []

    def flaky_cmd(line, check=True):
        calls.append(line)
        if len(calls) == 6:  # in the middle of configuring the first host
            raise KeyboardInterrupt
        return real_cmd(line, check)

    mine = f"-{os.getpid()}-"
    before = {n for n in _netns_names().split() if mine in n}
    monkeypatch.setattr(netns, "_cmd", flaky_cmd)
    with pytest.raises(KeyboardInterrupt):
        netns.NetnsCluster(num_hosts=2)
    monkeypatch.undo()
    assert len(calls) > 6  # teardown ran after the interrupt
    assert {n for n in _netns_names().split() if mine in n} == before
