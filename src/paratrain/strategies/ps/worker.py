"""The worker's side of the parameter-server protocol: push, pull, park, load, stats, done."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from paratrain.strategies.ps import protocol as proto


@dataclass(frozen=True)
class PSStats:
    """What the servers report: update count, time and staleness histograms.

    Attributes:
        updates: optimizer updates applied (rounds in sync/ssp, pushes in async).
        pushes: gradients received from all workers.
        elapsed_s: seconds since the servers started serving.
        replies: parameter ranges the first server has sent to workers.
        pending_sends: sends the first server still holds a buffer for (replies not yet
            known to be read); stays below a few per worker.
        histogram: int64 ``[num_workers, STALENESS_BINS]``: for each worker, how many
            of its gradients were applied ``k`` updates after the parameters they
            were computed on (bin ``k``; the last bin counts ``k >= 31``). Summed
            over servers, so with ``K`` servers each gradient counts ``K`` times.
    """

    updates: int
    pushes: int
    elapsed_s: float
    histogram: torch.Tensor
    replies: int = 0
    pending_sends: int = 0

    @property
    def max_staleness(self) -> int:
        """Largest staleness observed (0 if nothing was applied yet)."""
        seen = self.histogram.sum(dim=0).nonzero()
        return int(seen.max()) if seen.numel() else 0


_STATS_HEAD = 5  # updates, pushes, elapsed_us, replies, pending sends; then the histogram


class WorkerClient:
    """Talks to every server for one worker; parameters travel as one flat CPU vector."""

    def __init__(self, *, layout: proto.FlatLayout, params: list[torch.Tensor],
                 server_ranks: list[int], num_workers: int,
                 group: dist.ProcessGroup | None) -> None:
        self.layout, self.params, self.server_ranks, self.group = layout, params, server_ranks, group
        self.num_workers = num_workers
        self.flat = torch.empty(layout.numel, dtype=layout.dtype)
        self.outbox = proto.Outbox(group)

    # -- exchanges ------------------------------------------------------------------
    def push(self, lrs: list[float]) -> None:
        """Send this worker's gradients; receive (and load) the parameters of its next step."""
        grads = [p.grad.reshape(-1) if p.grad is not None
                 else torch.zeros(p.numel(), dtype=p.dtype, device=p.device) for p in self.params]
        flat_grad = torch.cat(grads).to("cpu", self.layout.dtype)
        for server, (lo, hi) in zip(self.server_ranks, self.layout.ranges):
            self.outbox.send(proto.make_header(proto.PUSH, 0, lrs), server, proto.HEADER)
            self.outbox.send(flat_grad[lo:hi], server, proto.PAYLOAD)
        self._receive_params()

    def pull(self, lrs: list[float]) -> None:
        self._send_headers(proto.PULL, 0, lrs)
        self._receive_params()

    def park(self, lrs: list[float], *, want_state: bool = False, if_changed: bool = False
             ) -> dict[str, torch.Tensor] | None:
        """Wait until every unfinished worker is parked; load the parameters then.

        With ``if_changed`` the servers send the parameters only where they changed
        since this worker last received them (a small flag otherwise): the cheap
        barrier in front of collectives. With ``want_state`` also return the servers'
        optimizer state, taken at the same consistent point, as one ``{name: tensor}``
        per server merged.
        """
        flags = (proto.PARK_WANTS_STATE if want_state else 0) | (
            proto.PARK_IF_CHANGED if if_changed else 0)
        self._send_headers(proto.PARK, flags, lrs)
        self._receive_params(only_if_fresh=if_changed)
        if not want_state:
            return None
        per_server = [self._wait(lambda s=s: proto.recv_tensor_dict(s, proto.STATE, self.group), s)
                      for s in self.server_ranks]
        return assemble_state(self.layout, per_server)

    def load(self, lrs: list[float], state: dict[int, dict[str, torch.Tensor]]) -> None:
        """Overwrite the servers' shards with this worker's parameters and ``state``."""
        flat = torch.cat([p.detach().reshape(-1).cpu() for p in self.params])
        for index, (server, (lo, hi)) in enumerate(zip(self.server_ranks, self.layout.ranges)):
            self.outbox.send(proto.make_header(proto.LOAD, 0, lrs), server, proto.HEADER)
            self.outbox.send(flat[lo:hi].clone(), server, proto.PAYLOAD)
            self.outbox.send_tensor_dict(split_state(self.layout, state, index), server,
                                         proto.STATE)
        self._wait(self.outbox.wait, self.server_ranks[0])

    def stats(self, lrs: list[float]) -> PSStats:
        self._send_headers(proto.STATS, 0, lrs)
        replies = []
        for server in self.server_ranks:
            reply = torch.empty(_STATS_HEAD + self.num_workers * proto.STALENESS_BINS, dtype=torch.int64)
            self._wait(lambda r=reply, s=server: dist.recv(r, s, group=self.group,
                                                           tag=proto.STATS_TAG), server)
            replies.append(reply)
        updates, pushes, elapsed_us, sent, pending = replies[0][:_STATS_HEAD].tolist()
        histogram = torch.stack([r[_STATS_HEAD:] for r in replies]).sum(dim=0)
        return PSStats(updates=updates, pushes=pushes, elapsed_s=elapsed_us / 1e6, replies=sent,
                       pending_sends=pending, histogram=histogram.reshape(self.num_workers, proto.STALENESS_BINS))

    def done(self, lrs: list[float]) -> None:
        self._send_headers(proto.DONE, 0, lrs)
        self._wait(self.outbox.wait, self.server_ranks[0])

    # -- plumbing -----------------------------------------------------------------------
    def _send_headers(self, kind: int, arg: int, lrs: list[float]) -> None:
        for server in self.server_ranks:
            self.outbox.send(proto.make_header(kind, arg, lrs), server, proto.HEADER)

    def _receive_params(self, *, only_if_fresh: bool = False) -> None:
        servers = list(zip(self.server_ranks, self.layout.ranges))
        if only_if_fresh:
            flags = [torch.empty(1, dtype=torch.int64) for _ in servers]
            for flag, (server, _) in zip(flags, servers):
                self._wait(lambda f=flag, s=server: dist.recv(f, s, group=self.group,
                                                              tag=proto.FRESH), server)
            servers = [pair for flag, pair in zip(flags, servers) if int(flag)]
        works = [(dist.irecv(self.flat[lo:hi], server, group=self.group, tag=proto.PARAMS), server)
                 for server, (lo, hi) in servers]
        for work, server in works:
            self._wait(work.wait, server)
        self._wait(self.outbox.wait, self.server_ranks[0])
        if not servers:
            return
        with torch.no_grad():
            for p, offset in zip(self.params, self.layout.offsets):
                p.copy_(self.flat[offset : offset + p.numel()].view_as(p))

    @staticmethod
    def _wait(fn, server: int):
        try:
            return fn()
        except RuntimeError as exc:
            reason = str(exc).strip().splitlines()[0][-160:] if str(exc).strip() else "error"
            raise RuntimeError(
                f"worker rank {dist.get_rank()}: no answer from parameter server rank {server} "
                f"within the run's timeout_s ({reason}); a server or another worker died or "
                "stalled, see the first failed rank"
            ) from None


def assemble_state(layout: proto.FlatLayout, per_server: list[dict[str, torch.Tensor]]
                   ) -> dict[int, dict[str, torch.Tensor]]:
    """Merge the servers' ``e``/``s`` entries into ``{param index: {key: full tensor}}``."""
    parts: dict[tuple[int, str], list[torch.Tensor]] = {}
    state: dict[int, dict[str, torch.Tensor]] = {}
    for tensors in per_server:  # servers hold consecutive ranges: pieces arrive in order
        for name, value in tensors.items():
            kind, param, key = name.split(":", 2)
            if kind == "e":
                parts.setdefault((int(param), key), []).append(value.reshape(-1))
            else:
                state.setdefault(int(param), {}).setdefault(key, value)
    for (param, key), pieces in parts.items():
        shape = layout.shapes[param]
        full = torch.cat(pieces)
        if full.numel() != shape.numel():
            raise RuntimeError(f"optimizer state {key!r} of parameter {param} is missing on "
                               "some server shards")
        state.setdefault(param, {})[key] = full.view(shape)
    return dict(sorted(state.items()))


def split_state(layout: proto.FlatLayout, state: dict[int, dict[str, torch.Tensor]],
                server: int) -> dict[str, torch.Tensor]:
    """The part of a per-parameter optimizer state that server ``server`` owns."""
    out = {}
    for piece in layout.pieces(server):
        shape = layout.shapes[piece.param]
        for key, value in state.get(piece.param, {}).items():
            if value is None:
                continue
            if not isinstance(value, torch.Tensor):
                value = torch.tensor(value, dtype=torch.float64)
            if value.shape == shape:
                out[f"e:{piece.param}:{key}"] = value.reshape(-1)[piece.start : piece.stop]
            else:
                out[f"s:{piece.param}:{key}"] = value
    return out
