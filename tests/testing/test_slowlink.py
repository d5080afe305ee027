"""The user-space slow link between two netns hosts: round trip and rate as asked.

Needs root and iproute2 (skipped otherwise), like tests/multinode.
"""

from __future__ import annotations

import sys
import time

import pytest

from paratrain.testing import netns, slowlink

_OK, _REASON = netns.netns_available()
pytestmark = [pytest.mark.multinode,
              pytest.mark.skipif(not _OK, reason=f"network namespaces unavailable: {_REASON}")]

SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(1); c, _ = s.accept()
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while c.recv(1) == b"p":  # ping-pong, then a bulk transfer answered with its size
    c.sendall(b"p")
n = 1
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    n += len(b)
c.sendall(str(n).encode())
"""
CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5001), timeout=30)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(5):
    t = time.perf_counter(); s.sendall(b"p"); s.recv(1); rtts.append(time.perf_counter() - t)
s.sendall(b"x"); t = time.perf_counter()
s.sendall(b"x" * 6_000_000); s.shutdown(socket.SHUT_WR)
n = int(s.recv(64)); print(min(rtts), (n - 1) / (time.perf_counter() - t))
"""


def test_link_has_the_delay_and_rate_asked():
    netns.cleanup_stale()
    with netns.NetnsCluster(num_hosts=2) as cluster:
        slowlink.connect(cluster, rate_mbit=50, delay_ms=15)
        h0, h1 = cluster.hosts
        h1.popen([sys.executable, "-c", SERVER])
        time.sleep(0.5)
        res = h0.run([sys.executable, "-c", CLIENT, h1.addr], timeout=60, capture_output=True)
        assert res.returncode == 0, res.stderr.decode()[-2000:]
        rtt, bytes_per_s = map(float, res.stdout.split())
    assert 0.030 <= rtt < 0.045, rtt  # 2 x 15 ms, never less
    # 50 Mbit/s = 6.25 MB/s at most; TCP's slow start and the round trips take some.
    assert 4.0e6 < bytes_per_s <= 6.4e6, bytes_per_s


def test_shape_link_installs_netem_or_says_why_in_one_line():
    with netns.NetnsCluster(num_hosts=2) as cluster:
        host = cluster.hosts[0]
        try:
            cluster.shape_link(0, rate="100mbit", delay_ms=20)
        except netns.NetnsUnavailable as exc:  # this kernel has no sch_netem
            assert str(exc).startswith("tc netem unavailable") and "\n" not in str(exc)
            return
        shown = host.run(["tc", "qdisc", "show", "dev", host.ifname], capture_output=True).stdout
        assert b"netem" in shown and b"delay 20ms" in shown, shown
