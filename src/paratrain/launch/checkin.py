"""The nodes' meeting of the pre-flight check, through ``torch.distributed.TCPStore``.

Node 0 serves a TCPStore on ``--master-port`` (the port torchrun's static rendezvous
uses next; this store is closed first, and torch's store sets ``SO_REUSEADDR``), so the
check reaches the very port the job needs. Keys, under ``paratrain/preflight/``:

* ``open``: set by node 0 first, so that a node meeting a store that is not a
  pre-flight check (node 0 started with ``--no-check``) says so instead of waiting;
* ``seq``: a counter; each node takes a number with ``add`` and writes its view under
  ``view/<number>`` (numbers, not node ranks, so that two nodes claiming one rank are
  both seen);
* ``verdict``: node 0's answer once every node checked in or the time is up: the
  views it judged and the lines (empty: go);
* ``ack``: incremented by each node that read the verdict; node 0 waits for these
  (briefly) before closing the store, so that nobody reads from a closed store;
* ``closing`` / ``left``: node 0 sets ``closing`` once the verdict is read; each other
  node answers with ``left`` (its last call), node 0 then closes the store, and the others
  give it a moment before going on. Otherwise a fast node's torchrun could connect to
  this store, still open on the master port, and lose it when node 0 closes it.

Waits poll with ``check`` rather than blocking ``wait``: a timed-out ``wait`` makes torch
log a warning with a C++ stack, and the check's own line is the report.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import timedelta

__all__ = ["exchange"]

PREFIX = "paratrain/preflight/"
POLL_S = 0.05
ACK_WAIT_S = 5.0  # how long node 0 keeps the store open for nodes to read the verdict
CLOSE_GRACE_S = 1.0  # after ``closing``: time for node 0 to close before torchrun connects
VERDICT_GRACE_S = 15.0  # beyond its own deadline, how long a node waits for node 0's verdict
OPEN_WAIT_S = 5.0  # how long a node looks for node 0's ``open`` mark after connecting

Judge = Callable[[list[dict]], list[str]]


class _Failed(RuntimeError):
    pass


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    text = text.splitlines()[0] if text else type(exc).__name__
    return text.rsplit("message: ", 1)[-1][:200]  # torch's socket errors end "message: why"


def exchange(view: dict, *, name: str, master_addr: str, port: int, expected_nodes: int,
             deadline: float, timeout_s: float, judge: Judge) -> tuple[list[dict], list[str]]:
    """Meet the other nodes; return the views node 0 judged and its lines (empty: agree).

    ``view`` is this node's (a JSON-able dict with ``node_rank``), ``name`` how lines
    name this node, ``deadline`` a ``time.monotonic()`` time; ``judge(views)`` gives the
    lines for the views that checked in (run on node 0). Failures of the meeting itself
    (port taken, node 0 lost or silent) come back as one line.
    """
    from torch.distributed import TCPStore

    is_master = view["node_rank"] == 0
    where = f"{master_addr}:{port}"
    left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    try:
        store = TCPStore(master_addr, port, None, is_master, left, wait_for_workers=False)
    except Exception as exc:  # torch raises DistNetworkError / RuntimeError variants
        if is_master:
            return [], [f"{name} cannot listen on --master-port {port} ({_first_line(exc)}); "
                        "pick another --master-port, or stop what uses it"]
        return [], [f"{name} cannot reach node 0's store at {where} ({_first_line(exc)}); "
                    "check --master-addr/--master-port and the firewall"]
    try:
        if is_master:
            store.set(PREFIX + "open", "1")
        else:
            _await_open(store, name, where, min(deadline, time.monotonic() + OPEN_WAIT_S))
        seq = int(store.add(PREFIX + "seq", 1))
        store.set(f"{PREFIX}view/{seq}", json.dumps(view))
        if is_master:
            return _judge(store, expected_nodes, deadline, timeout_s, where, judge)
        return _await_verdict(store, seq, name, where, deadline + VERDICT_GRACE_S, timeout_s)
    except _Failed as exc:
        return [], [str(exc)]
    except Exception as exc:  # the store's connection broke: node 0 went away
        return [], [f"{name} lost node 0 at {where} during the pre-flight check "
                    f"({_first_line(exc)}); look at node 0's log"]
    finally:
        del store  # closes the connection, or the server on node 0


def _await_open(store, name: str, where: str, deadline: float) -> None:
    while not store.check([PREFIX + "open"]):
        if time.monotonic() >= deadline:
            raise _Failed(
                f"{name} found no pre-flight check at node 0's {where} (node 0 runs with "
                "--no-check, or another job holds the port); start every node alike, with "
                "or without --no-check")
        time.sleep(POLL_S)


def _judge(store, expected_nodes: int, deadline: float, timeout_s: float, where: str,
           judge: Judge) -> tuple[list[dict], list[str]]:
    views: dict[int, dict] = {}
    while True:
        count = int(store.add(PREFIX + "seq", 0))
        for seq in range(1, count + 1):
            key = f"{PREFIX}view/{seq}"
            if seq not in views and store.check([key]):
                views[seq] = json.loads(store.get(key))
        ranks = {v["node_rank"] for v in views.values()}
        if ranks >= set(range(expected_nodes)) or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    lines = judge(list(views.values()))
    missing = sorted(set(range(expected_nodes)) - ranks)
    if missing:
        lines.append(f"node(s) {', '.join(map(str, missing))} of --nnodes {expected_nodes} did "
                     f"not check in within {timeout_s:g} s (node 0 waited at {where}); start "
                     "them with the same --master-addr and --master-port, or look at their "
                     "logs (--join-timeout sets the wait)")
    store.set(PREFIX + "verdict", json.dumps(
        {"views": list(views.values()), "seen": sorted(views), "lines": lines}))
    others = len(views) - 1
    until = time.monotonic() + ACK_WAIT_S
    while int(store.add(PREFIX + "ack", 0)) < others and time.monotonic() < until:
        time.sleep(POLL_S)
    store.set(PREFIX + "closing", "1")
    until = time.monotonic() + ACK_WAIT_S
    while int(store.add(PREFIX + "left", 0)) < others and time.monotonic() < until:
        time.sleep(POLL_S)
    return list(views.values()), lines


def _await_verdict(store, seq: int, name: str, where: str, deadline: float,
                   timeout_s: float) -> tuple[list[dict], list[str]]:
    while not store.check([PREFIX + "verdict"]):
        if time.monotonic() >= deadline:
            raise _Failed(
                f"{name} got no pre-flight answer from node 0 at {where} within "
                f"{timeout_s:g} s; look at node 0's log (--join-timeout sets the wait)")
        time.sleep(POLL_S)
    verdict = json.loads(store.get(PREFIX + "verdict"))
    store.add(PREFIX + "ack", 1)
    until = time.monotonic() + ACK_WAIT_S + CLOSE_GRACE_S
    while not store.check([PREFIX + "closing"]) and time.monotonic() < until:
        time.sleep(POLL_S)
    store.add(PREFIX + "left", 1)  # the last call: node 0 may close the store now
    time.sleep(CLOSE_GRACE_S)
    lines = list(verdict["lines"])
    if seq not in verdict["seen"]:
        lines.append(f"{name} checked in after node 0 had judged the others; start every "
                     "node within --join-timeout, each with its own --node-rank")
    return verdict["views"], lines
