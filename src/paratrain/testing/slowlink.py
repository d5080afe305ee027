"""A slow point-to-point link between two :class:`~paratrain.testing.netns.NetnsCluster`
hosts, emulated in user space, for kernels without ``sch_netem``.

``connect(cluster, rate_mbit=100, delay_ms=20)`` starts a forwarder process inside host 0
that owns one ``tun`` device in each of the two hosts and routes each host's traffic to
the other's address (a ``/32`` route, which beats the bridge's ``/24``) through them.
Each direction behaves like ``tc qdisc add ... netem delay 20ms rate 100mbit limit
1000``: packets leave one after another at ``rate`` (a FIFO; beyond ``limit`` queued
packets they are dropped), and each arrives ``delay`` after it left, so the round trip
is twice the delay. The hosts keep their addresses, so ``GLOO_SOCKET_IFNAME`` (the veth)
still names the right address; only the path changes. The forwarder is one of the
cluster's processes: ``cluster.close()`` ends it, and the tun devices go with it.

Timing is as good as the forwarder's wake-ups: on a loaded machine a packet may arrive
late by a scheduler slice, never early.
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import sys
import time
from collections import deque

from paratrain.testing.netns import NetnsCluster, _cmd

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MTU = 65535


def _open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def forward(names: tuple[str, str], rate_mbit: float, delay_ms: float, limit: int) -> None:
    """Open both tun devices, say ``ready``, then forward between them forever."""
    fds = [_open_tun(name) for name in names]
    print("ready", flush=True)
    bytes_per_s, delay = rate_mbit * 1e6 / 8, delay_ms / 1e3
    queues: list[deque] = [deque(), deque()]  # per direction: (arrival time, packet)
    free_at = [0.0, 0.0]  # when each direction's "wire" is free again
    while True:
        now = time.monotonic()
        heads = [q[0][0] for q in queues if q]
        timeout = max(0.0, min(heads) - now) if heads else None
        ready, _, _ = select.select(fds, [], [], timeout)
        now = time.monotonic()
        for fd in ready:
            d = fds.index(fd)
            while True:
                try:
                    packet = os.read(fd, MTU + 64)
                except BlockingIOError:
                    break
                if len(queues[d]) >= limit:
                    continue  # dropped, as netem drops past its limit
                free_at[d] = max(now, free_at[d]) + len(packet) / bytes_per_s
                queues[d].append((free_at[d] + delay, packet))
        now = time.monotonic()
        for d, queue in enumerate(queues):
            while queue and queue[0][0] <= now:
                try:
                    os.write(fds[1 - d], queue.popleft()[1])
                except OSError:
                    pass  # the receiving host's device went away or is full: a drop


def connect(cluster: NetnsCluster, rate_mbit: float = 100.0, delay_ms: float = 20.0,
            limit: int = 1000, timeout: float = 30.0) -> subprocess.Popen:
    """Route hosts 0 and 1 of ``cluster`` to each other over the emulated link."""
    h0, h1 = cluster.hosts[:2]
    names = (f"pt{cluster.id}s0", f"pt{cluster.id}s1")
    proc = h0.popen([sys.executable, "-m", __name__, *names, str(rate_mbit), str(delay_ms),
                     str(limit)], stdout=subprocess.PIPE, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    if not ready or proc.stdout.readline().strip() != "ready":
        raise RuntimeError(f"slow link forwarder did not start (exit code {proc.poll()})")
    os.set_blocking(proc.stdout.fileno(), False)
    _cmd(f"ip -n {h0.netns} link set {names[1]} netns {h1.netns}")
    for host, name, peer in ((h0, names[0], h1), (h1, names[1], h0)):
        _cmd(f"ip -n {host.netns} link set {name} mtu {MTU} up")
        _cmd(f"ip -n {host.netns} route add {peer.addr}/32 dev {name}")
    return proc


if __name__ == "__main__":
    with __import__("contextlib").suppress(OSError):
        os.nice(-10)  # the forwarder's wake-ups are the link's timing
    forward((sys.argv[1], sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]),
            int(sys.argv[5]))
