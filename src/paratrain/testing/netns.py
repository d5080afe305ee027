"""Fake multi-host clusters on one Linux machine, built from network namespaces.

``NetnsCluster(num_hosts=N)`` makes N hosts (namespaces ``ptnet-<id>-<pid>-h<i>``: ``lo`` up,
one veth, MTU 65535, address ``10.213.<random>.<i+1>/24``) whose veth peers are ports of a
bridge in its own namespace ``ptnet-<id>-<pid>-br``.  Nothing is added to the machine's own
namespace; the /24 exists only inside the hosts.  ``close()`` / leaving the ``with`` block
(also on exceptions and Ctrl-C) kills every process in the namespaces and deletes them;
:func:`cleanup_stale` removes leftovers of killed runs.  Needs root and iproute2.

Launching torch.distributed across the hosts (the hostname resolves to loopback everywhere,
so nothing may depend on it):

* ``GLOO_SOCKET_IFNAME=<host.ifname>`` (set by :meth:`NetnsHost.popen`); without it gloo
  binds to the hostname's address (127.0.0.1) and the ranks never connect.
* static rendezvous, on host K: ``python -m torch.distributed.run --nnodes 2
  --nproc-per-node 1 --node-rank K --master-addr <hosts[0].addr> --master-port P script.py``
* c10d rendezvous, on host K: ``python -m torch.distributed.run --nnodes 2
  --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint <hosts[0].addr>:P --rdzv-id X
  --local-addr <hosts[K].addr> script.py``, plus ``--rdzv-conf is_host=1`` on host 0 only.
  Both are required: torch matches the endpoint against the hostname's addresses, so
  without ``is_host=1`` nobody serves the store; ``--local-addr`` is published as
  MASTER_ADDR, without it the hostname is and remote workers connect to themselves.

Ports need no coordination: every namespace has its own, empty port space.
"""

from __future__ import annotations

import atexit
import glob
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from functools import lru_cache

import psutil

PREFIX = "ptnet-"
MTU = 65535
RUN_STARTED = time.time()
_OPEN: set[NetnsCluster] = set()  # strong refs: unclosed clusters are closed at exit


class NetnsUnavailable(RuntimeError):
    """Network namespaces (or an optional feature such as ``tc``) cannot be used here."""


def _cmd(line: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run an ``ip``/``tc`` command line; raise RuntimeError with its stderr on failure."""
    res = subprocess.run(line.split(), capture_output=True, text=True, timeout=30)
    if check and res.returncode != 0:
        raise RuntimeError(f"{line} failed: {res.stderr.strip() or res.returncode}")
    return res


@lru_cache(maxsize=1)
def netns_available() -> tuple[bool, str]:
    """``(True, "")`` if namespaces with veth pairs can be made here, else ``(False, reason)``."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        return False, "network namespaces need Linux and root"
    if shutil.which("ip") is None:
        return False, "iproute2 `ip` not found"
    probe = f"{PREFIX}probe{random.randrange(16**6):06x}-{os.getpid()}-p"
    try:
        _cmd(f"ip netns add {probe}")
        _cmd(f"ip -n {probe} link add pa type veth peer name pb")
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        return False, f"cannot create network namespace/veth: {exc}".splitlines()[0]
    finally:
        _cmd(f"ip netns del {probe}", check=False)
    return True, ""


def _alive(pid: int, born_before: float | None = None) -> bool:
    """``pid`` runs (zombies are dead) and, if given, started before ``born_before``."""
    with suppress(psutil.Error):
        proc = psutil.Process(pid)
        born_ok = born_before is None or proc.create_time() <= born_before
        return born_ok and proc.status() != psutil.STATUS_ZOMBIE
    return False


def kill_pids(pids: Sequence[int], grace: float = 5.0) -> None:
    """SIGTERM processes and their groups (never the caller's), SIGKILL leftovers after grace."""
    pids = [p for p in dict.fromkeys(pids) if p != os.getpid()]
    pgids: set[int] = set()
    for pid in pids:
        with suppress(OSError):
            pgids.add(os.getpgid(pid))
    pgids.discard(os.getpgrp())
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        if not any(_alive(p) for p in pids):
            return
        for kill, targets in ((os.killpg, pgids), (os.kill, pids)):
            for target in targets:
                with suppress(OSError):
                    kill(target, sig)
        deadline = time.monotonic() + wait
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)


def kill_process_tree(proc: subprocess.Popen | int, grace: float = 5.0) -> None:
    """Kill a process, its group and all descendants (torchrun workers have own sessions):
    SIGTERM, then SIGKILL after ``grace`` seconds; a ``Popen`` is reaped afterwards."""
    pids = [proc if isinstance(proc, int) else proc.pid]
    with suppress(psutil.Error):
        pids += [c.pid for c in psutil.Process(pids[0]).children(recursive=True)]
    kill_pids(pids, grace=grace)
    if isinstance(proc, subprocess.Popen):
        with suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=5)


@dataclass
class NetnsHost:
    """One fake host: a namespace with ``lo`` and one veth ``ifname`` holding ``addr``."""

    index: int
    netns: str
    addr: str
    ifname: str
    bridge_port: str  # the veth peer, inside the bridge namespace
    _cluster: NetnsCluster = field(repr=False, compare=False)

    @property
    def env(self) -> dict[str, str]:
        """Environment variables that pin torch.distributed sockets to this host's veth."""
        return {"GLOO_SOCKET_IFNAME": self.ifname, "TP_SOCKET_IFNAME": self.ifname}

    def popen(self, argv: Sequence[str], env: dict[str, str] | None = None, **kwargs):
        """``Popen`` in the namespace and a new session; ``env`` (default os.environ) + .env."""
        if self._cluster._closed:
            raise RuntimeError("cluster is closed")
        kwargs.setdefault("start_new_session", True)
        env = {**(os.environ if env is None else env), **self.env}
        proc = subprocess.Popen(["ip", "netns", "exec", self.netns, *argv], env=env, **kwargs)
        self._cluster._procs.append(proc)
        return proc

    def run(self, argv: Sequence[str], timeout: float = 60.0, check: bool = False,
            input: str | bytes | None = None, capture_output: bool = False, **kwargs):
        """Like ``subprocess.run`` inside the namespace; kills the whole tree on timeout/error."""
        if capture_output:
            kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc = self.popen(argv, stdin=None if input is None else subprocess.PIPE, **kwargs)
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except BaseException:
            kill_process_tree(proc, grace=1.0)
            raise
        res = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        if check:
            res.check_returncode()
        return res


class NetnsCluster:
    """``num_hosts`` hosts on one bridge; a context manager.  May raise NetnsUnavailable."""

    def __init__(self, num_hosts: int = 2) -> None:
        if not 1 <= num_hosts <= 250:
            raise ValueError("num_hosts must be in 1..250")
        ok, reason = netns_available()
        if not ok:
            raise NetnsUnavailable(reason)
        self.id = f"{random.randrange(16**6):06x}"
        self.subnet = f"10.213.{random.randrange(256)}.0/24"
        self.hosts: list[NetnsHost] = []
        self._procs: list[subprocess.Popen] = []
        self._timers: dict[int, threading.Timer] = {}
        self.namespaces: list[str] = []  # bridge first, then hosts
        self._closed = False
        self._owner_pid = os.getpid()  # a forked child must not tear down the parent's cluster
        base = f"{PREFIX}{self.id}-{self._owner_pid}"
        self.bridge_netns = f"{base}-br"
        _OPEN.add(self)
        try:
            self._add_netns(self.bridge_netns)
            _cmd(f"ip -n {self.bridge_netns} link add br0 mtu {MTU} type bridge")
            for i in range(num_hosts):
                self._add_host(i, f"{base}-h{i}")
            _cmd(f"ip -n {self.bridge_netns} link set br0 up")
        except BaseException as exc:
            self.close()
            if isinstance(exc, RuntimeError):
                raise NetnsUnavailable(str(exc).splitlines()[0]) from exc
            raise

    def _add_netns(self, name: str) -> None:
        self.namespaces.append(name)  # recorded first so an interrupt cannot leak it
        _cmd(f"ip netns add {name}")

    def _add_host(self, i: int, ns: str) -> None:
        br, ifname, port = self.bridge_netns, f"pt{self.id}h{i}", f"pt{self.id}b{i}"
        addr = f"{self.subnet.rsplit('.', 1)[0]}.{i + 1}"
        self._add_netns(ns)
        _cmd(f"ip -n {br} link add {port} mtu {MTU} type veth "
             f"peer name {ifname} mtu {MTU} netns {ns}")
        _cmd(f"ip -n {br} link set {port} master br0 up")
        _cmd(f"ip -n {ns} link set lo up")
        _cmd(f"ip -n {ns} addr add {addr}/24 dev {ifname}")
        _cmd(f"ip -n {ns} link set {ifname} up")
        self.hosts.append(NetnsHost(i, ns, addr, ifname, port, self))

    def _set_port(self, host_index: int, state: str, check: bool = True) -> None:
        port = self.hosts[host_index].bridge_port
        _cmd(f"ip -n {self.bridge_netns} link set {port} {state}", check=check)

    def cut_link(self, host_index: int, seconds: float | None = None) -> None:
        """Take the host's bridge port down; with ``seconds``, restore it in the background."""
        self._cancel_timer(host_index)
        self._set_port(host_index, "down")
        if seconds is not None:
            timer = threading.Timer(seconds, self._set_port, (host_index, "up", False))
            timer.daemon = True
            self._timers[host_index] = timer
            timer.start()

    def restore_link(self, host_index: int) -> None:
        """Bring the host's bridge port back up (undo :meth:`cut_link`)."""
        self._cancel_timer(host_index)
        self._set_port(host_index, "up")

    def _cancel_timer(self, host_index: int) -> None:
        with suppress(KeyError):
            self._timers.pop(host_index).cancel()

    def limit_rate(self, host_index: int, rate: str | None = "200mbit", burst: str = "256kb",
                   latency: str = "50ms") -> None:
        """Shape the host's egress with ``tc tbf`` on its veth (tc syntax); ``None`` removes it."""
        if shutil.which("tc") is None:
            raise NetnsUnavailable("`tc` (iproute2) not found; rate limiting unavailable")
        host = self.hosts[host_index]
        qdisc = f"tc -n {host.netns} qdisc"
        if rate is None:
            _cmd(f"{qdisc} del dev {host.ifname} root", check=False)
        else:
            _cmd(f"{qdisc} replace dev {host.ifname} root tbf "
                 f"rate {rate} burst {burst} latency {latency}")

    def shape_link(self, host_index: int, rate: str = "100mbit", delay_ms: float = 20.0,
                   limit: int = 1000) -> None:
        """``tc netem`` on the host's egress: ``rate`` and a one-way ``delay_ms`` (shape both
        hosts for a round trip of twice that); :meth:`limit_rate` with ``None`` removes it.
        NetnsUnavailable where the kernel lacks ``sch_netem``: :mod:`.slowlink` emulates it."""
        host = self.hosts[host_index]
        try:
            _cmd(f"tc -n {host.netns} qdisc replace dev {host.ifname} root netem "
                 f"delay {delay_ms}ms rate {rate} limit {limit}")
        except (RuntimeError, OSError) as exc:
            raise NetnsUnavailable(f"tc netem unavailable: {exc}".splitlines()[0]) from exc

    def close(self) -> None:
        """Kill every process in the namespaces and delete them.  Idempotent."""
        if self._closed or os.getpid() != self._owner_pid:
            return
        self._closed = True
        try:
            for idx in list(self._timers):
                self._cancel_timer(idx)
            for proc in self._procs:
                if proc.poll() is None:
                    kill_process_tree(proc, grace=2.0)
            for ns in reversed(self.namespaces):
                _delete_netns(ns)
            _OPEN.discard(self)
        except KeyboardInterrupt:  # Ctrl-C during teardown: finish it (every step is
            self._closed = False  # idempotent), then re-raise
            self.close()
            raise

    def __enter__(self) -> NetnsCluster:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def _delete_netns(name: str) -> None:
    """Kill whatever still runs inside namespace ``name``, then delete it."""
    kill_pids([int(p) for p in _cmd(f"ip netns pids {name}", check=False).stdout.split()], 2.0)
    _cmd(f"ip netns del {name}", check=False)


def cleanup_stale(older_than: float | None = None) -> list[str]:
    """Delete harness namespaces created before ``older_than`` (default: when this module
    was imported) whose creating process is gone.  Returns the deleted names."""
    cutoff = RUN_STARTED if older_than is None else older_than
    removed: list[str] = []
    for path in sorted(glob.glob(f"/run/netns/{PREFIX}*")):
        name, parts = os.path.basename(path), os.path.basename(path).split("-")
        if len(parts) != 4 or not parts[2].isdigit() or int(parts[2]) == os.getpid():
            continue
        with suppress(OSError):
            created = os.stat(path).st_mtime
            if created < cutoff and not _alive(int(parts[2]), born_before=created + 1.0):
                _delete_netns(name)
                removed.append(name)
    return removed


atexit.register(lambda: [cluster.close() for cluster in list(_OPEN)])
