"""One parameter-server rank: a shard of the parameters, its optimizer, and the serve loop.

Consistency modes, all driven by one loop over messages from whichever worker is ready:

* ``async``: each pushed gradient is one optimizer step, applied on arrival;
  the pushing worker gets the new parameters at once.
* ``ssp`` with staleness ``s``: gradients are grouped into rounds by the
  worker's clock (its number of pushes). Round ``r`` is averaged and applied
  once every active worker has pushed into it. A worker at clock ``c`` gets its
  reply (and may compute step ``c``) only while ``c - rounds_applied <= s``, so
  no worker runs more than ``s`` steps ahead of the slowest and no gradient is
  applied more than ``s`` updates after the parameters it was computed on.
* ``sync`` is ``ssp`` with ``s = 0``: each round averages one gradient per
  worker, exactly like an all-reduce.

``park`` is the server's barrier that tolerates finished workers: a parked
worker pushes nothing (its rounds close without it) and is released, with the
current parameters, once every worker that is not done is parked.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from paratrain.strategies.ps import protocol as proto


def staleness_weight(staleness: int, weighting: str) -> float:
    """A gradient's weight: 1, or ``1 / (1 + staleness)`` under ``inverse``."""
    return 1.0 / (1 + staleness) if weighting == "inverse" else 1.0


def average_round(grads: list[torch.Tensor], stalenesses: list[int],
                  weighting: str) -> torch.Tensor:
    """One ssp round's update: the (weighted) mean of its gradients, summed in list order.

    Sums into the first gradient's storage. With equal weights (always, when every
    gradient is fresh) this is exactly the plain mean an all-reduce computes: weights of
    1 multiply exactly.
    """
    weights = [staleness_weight(s, weighting) for s in stalenesses]
    total = grads[0].mul_(weights[0])
    for grad, weight in zip(grads[1:], weights[1:]):
        total = total.add_(grad, alpha=weight)
    return total.div_(sum(weights))


class ParameterServer:
    """Serve one shard until every worker has sent ``done``.

    Args:
        layout: the flat layout shared with the workers.
        server_index: which shard (0 .. num_servers - 1) this rank owns.
        worker_ranks: global ranks of the workers.
        mode: ``sync``, ``async`` or ``ssp``.
        staleness: the ssp bound (0 for sync).
        staleness_weighting: ``equal`` or ``inverse`` (see :func:`staleness_weight`).
        optimizer: the user's optimizer; its parameters give the initial values and
            its class, defaults and param groups the server's optimizer.
        optimizer_factory: builds the server's optimizer from param groups instead.
        group: process group carrying the messages (None: the default group).
        timeout_s: how long to wait for any message before declaring the job lost.
    """

    def __init__(self, *, layout: proto.FlatLayout, server_index: int, worker_ranks: list[int],
                 mode: str, staleness: int, staleness_weighting: str,
                 optimizer: torch.optim.Optimizer,
                 optimizer_factory: Callable | None, group: dist.ProcessGroup | None,
                 timeout_s: float) -> None:
        self.layout, self.mode, self.group, self.timeout_s = layout, mode, group, timeout_s
        self.staleness = 0 if mode == "sync" else staleness
        self.weighting = staleness_weighting
        lo, hi = layout.ranges[server_index]
        flat = torch.cat([p.detach().reshape(-1).cpu() for g in optimizer.param_groups
                          for p in g["params"]])
        self.shard = flat[lo:hi].clone()
        self.pieces = layout.pieces(server_index)
        self.params: list[nn.Parameter] = []
        groups: dict[int, list[nn.Parameter]] = {}
        for piece in self.pieces:
            param = nn.Parameter(torch.empty(0, dtype=self.shard.dtype))
            # A view into the shard: the optimizer updates the shard in place.
            param.data = self.shard[piece.local : piece.local + piece.stop - piece.start]
            self.params.append(param)
            groups.setdefault(piece.group, []).append(param)
        self._group_of = list(groups)
        param_groups = [{**{k: v for k, v in optimizer.param_groups[g].items() if k != "params"},
                         "params": params} for g, params in groups.items()]
        if optimizer_factory is not None:
            self.optimizer = optimizer_factory(param_groups)
        else:
            self.optimizer = type(optimizer)(param_groups, **optimizer.defaults)
        self.num_groups = len(optimizer.param_groups)
        self.workers = list(worker_ranks)
        self.active, self.done = set(self.workers), set()
        self.parked: dict[int, int] = {}  # rank -> its park flags (proto.PARK_*)
        self.deferred: set[int] = set()  # pushed, waiting for the staleness bound
        self.clock = dict.fromkeys(self.workers, 0)
        self.pulled = dict.fromkeys(self.workers, 0)  # version each worker last received
        self.rounds: dict[int, dict[int, tuple[torch.Tensor, int]]] = {}
        self.version = 0  # optimizer updates applied
        self.pushes = 0
        self.replies = 0  # parameter ranges sent
        self.histogram = torch.zeros(len(self.workers), proto.STALENESS_BINS, dtype=torch.int64)
        self.outbox = proto.Outbox(group)
        self._started = time.perf_counter()

    # -- the loop -------------------------------------------------------------------
    def serve(self) -> None:
        """Handle messages until every worker is done."""
        header = torch.empty(2 + self.num_groups, dtype=torch.int64)
        handlers = {proto.PUSH: self._on_push, proto.PULL: self._on_pull,
                    proto.PARK: self._on_park, proto.DONE: self._on_done,
                    proto.LOAD: self._on_load, proto.STATS: self._on_stats}
        while len(self.done) < len(self.workers):
            src = self._recv_header(header)
            # A worker sends its next request only after reading every reply to its last
            # one: the sends to it are complete, and their buffers can go. Without this a
            # server would hold every parameter copy it ever sent (gloo reports a send
            # complete only once it is waited for).
            self.outbox.settle(src)
            kind, arg, lrs = proto.parse_header(header)
            if src not in self.clock or kind not in handlers:
                raise RuntimeError(f"parameter server rank {dist.get_rank()}: unexpected "
                                   f"message kind {kind} from rank {src}")
            handlers[kind](src, arg, lrs)
        self.outbox.wait()

    def _recv_header(self, header: torch.Tensor) -> int:
        try:
            return dist.recv(header, src=None, group=self.group, tag=proto.HEADER)
        except RuntimeError as exc:
            reason = str(exc).strip().splitlines()[0][-160:] if str(exc).strip() else "error"
            waiting = sorted(set(self.workers) - self.done)
            raise RuntimeError(
                f"parameter server rank {dist.get_rank()} lost its workers: no message from "
                f"worker ranks {waiting} within timeout_s={self.timeout_s:g} ({reason}); "
                "a worker died or stalled, see the first failed rank"
            ) from None

    # -- handlers ---------------------------------------------------------------------
    def _on_push(self, src: int, arg: int, lrs: list[float]) -> None:
        grad = torch.empty_like(self.shard)
        dist.recv(grad, src, group=self.group, tag=proto.PAYLOAD)
        self._set_lrs(lrs)
        self.pushes += 1
        if self.mode == "async":
            staleness = self.version - self.pulled[src]
            self._record(src, staleness)
            weight = staleness_weight(staleness, self.weighting)
            self._apply(grad if weight == 1 else grad.mul_(weight))
            self._reply(src)
            return
        self.rounds.setdefault(self.clock[src], {})[src] = (grad, self.pulled[src])
        self.clock[src] += 1
        self.deferred.add(src)
        self._progress()

    def _on_pull(self, src: int, arg: int, lrs: list[float]) -> None:
        self._reply(src)

    def _on_park(self, src: int, arg: int, lrs: list[float]) -> None:
        self.active.discard(src)
        self.parked[src] = arg
        self._progress()

    def _on_done(self, src: int, arg: int, lrs: list[float]) -> None:
        self.active.discard(src)
        self.parked.pop(src, None)
        self.done.add(src)
        self._progress()

    def _on_load(self, src: int, arg: int, lrs: list[float]) -> None:
        shard = torch.empty_like(self.shard)
        dist.recv(shard, src, group=self.group, tag=proto.PAYLOAD)
        self.shard.copy_(shard)
        self._load_optimizer_state(proto.recv_tensor_dict(src, proto.STATE, self.group))

    def _on_stats(self, src: int, arg: int, lrs: list[float]) -> None:
        elapsed_us = int((time.perf_counter() - self._started) * 1e6)
        head = torch.tensor([self.version, self.pushes, elapsed_us, self.replies,
                             len(self.outbox)], dtype=torch.int64)
        self.outbox.send(torch.cat([head, self.histogram.reshape(-1)]), src, proto.STATS_TAG)

    # -- rounds, replies and releases ----------------------------------------------------
    def _progress(self) -> None:
        # Close every round all active workers have pushed into, oldest first.
        while self.version in self.rounds and all(
            self.clock[w] > self.version for w in self.active
        ):
            contributions = self.rounds.pop(self.version)
            # A fixed order (by rank) makes the sum independent of arrival order.
            grads, stalenesses = [], []
            for worker in sorted(contributions):
                grad, pulled = contributions[worker]
                self._record(worker, self.version - pulled)
                grads.append(grad)
                stalenesses.append(self.version - pulled)
            self._apply(average_round(grads, stalenesses, self.weighting))
        for worker in sorted(self.deferred):
            if self.clock[worker] - self.version <= self.staleness:
                self.deferred.discard(worker)
                self._reply(worker)
        if self.parked and not self.active:
            # Every worker that is not done is parked: a consistent cut. Release them all.
            for worker, flags in sorted(self.parked.items()):
                self.clock[worker] = max(self.clock[worker], self.version)
                self.active.add(worker)
                if flags & proto.PARK_IF_CHANGED:
                    # A park before a collective: in lock-step training nothing changed
                    # since the worker's last reply, so a flag replaces the parameters.
                    changed = self.pulled[worker] != self.version
                    self.outbox.send(torch.tensor([int(changed)]), worker, proto.FRESH)
                    if changed:
                        self._reply(worker)
                else:
                    self._reply(worker)
                if flags & proto.PARK_WANTS_STATE:
                    self.outbox.send_tensor_dict(self._optimizer_state(), worker, proto.STATE)
            self.parked.clear()

    def _apply(self, grad: torch.Tensor) -> None:
        for param, piece in zip(self.params, self.pieces):
            param.grad = grad[piece.local : piece.local + piece.stop - piece.start]
        self.optimizer.step()
        self.version += 1

    def _reply(self, worker: int) -> None:
        self.pulled[worker] = self.version
        self.replies += 1
        # A copy: the shard keeps changing while the send is in flight.
        self.outbox.send(self.shard.clone(), worker, proto.PARAMS)

    def _record(self, worker: int, staleness: int) -> None:
        self.histogram[self.workers.index(worker), min(staleness, proto.STALENESS_BINS - 1)] += 1

    def _set_lrs(self, lrs: list[float]) -> None:
        # The workers' optimizer carries the schedule; the server follows its learning rate.
        for group, user_group in zip(self.optimizer.param_groups, self._group_of):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lrs[user_group])
            else:
                group["lr"] = lrs[user_group]

    # -- optimizer state as tensors named "<e|s>:<param>:<key>" --------------------------
    def _optimizer_state(self) -> dict[str, torch.Tensor]:
        """``e`` entries are elementwise (shaped like the piece), ``s`` entries per parameter."""
        out = {}
        for param, piece in zip(self.params, self.pieces):
            for key, value in self.optimizer.state.get(param, {}).items():
                if value is None:
                    continue
                if not isinstance(value, torch.Tensor):
                    value = torch.tensor(value, dtype=torch.float64)
                kind = "e" if value.shape == param.shape else "s"
                out[f"{kind}:{piece.param}:{key}"] = value
        return out

    def _load_optimizer_state(self, tensors: dict[str, torch.Tensor]) -> None:
        state: dict[int, dict[str, torch.Tensor]] = {}
        by_param = {piece.param: index for index, piece in enumerate(self.pieces)}
        for name, value in tensors.items():
            _, param, key = name.split(":", 2)
            state.setdefault(by_param[int(param)], {})[key] = value
        full = self.optimizer.state_dict()
        full["state"] = state
        self.optimizer.load_state_dict(full)
