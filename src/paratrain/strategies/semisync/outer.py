"""The outer step of semi-synchronous training, across the replicate axis.

Each replica group runs the user's optimizer alone (FSDP and tensor parallel inside it);
after every ``H`` optimizer steps (per fragment) :class:`OuterSync` makes the groups
agree again, over the mesh's ``replicate`` group, on this rank's local pieces (a
DTensor's ``to_local()``: the replicate peers of a rank hold the same shard layout):

* :class:`~paratrain.parallel.options.LocalSGD`: the parameters' mean,
  ``sum(x_i) / R``, in place;
* :class:`~paratrain.parallel.options.DiLoCo`: the mean pseudo-gradient
  ``d = s - mean(x_i)`` (``s`` the parameters of the last outer step, kept here) and an
  outer SGD step on ``s`` with (Nesterov) momentum ``m``: ``m = mu m + d``;
  ``s -= lr (d + mu m)`` (``lr m`` without Nesterov); the parameters become ``s``.

The arithmetic, written so that the reductions are exact: in full precision the groups
all-reduce their parameters (the same bytes as the pseudo-gradients, the same sum as
local SGD's) and the step is ``s = lerp(s, mean(x_i), lr) - lr mu m`` (``m`` the new
momentum with Nesterov, the old one without), which is ``s - lr (d + mu m)``: torch's
``lerp`` with weight 1 returns its end exactly, so DiLoCo with ``outer_lr=1,
outer_momentum=0`` is local SGD bit for bit. ``s - mean(x_i)`` itself would not do:
``s - x_i`` is exact only within a factor 2 of ``s`` (Sterbenz), and parameters near 0
leave it. With ``comm_dtype="bf16"`` the pseudo-gradients ``(s - x_i) / R`` are sent
instead (small numbers lose less to bfloat16 than parameters) and
``mean(x_i) = s - sum``. With ``comm_dtype="int8"`` each rank quantizes its own ``s - x_i``
with its own scale and the ranks all-gather them (int8 sums would overflow); every rank
then averages the same bytes in rank order (:mod:`.quantize`), so the groups stay equal.

With ``overlap`` a fragment's all-reduce runs while the next inner step does and is
finished after it: the outer step is computed from pseudo-gradients one inner step old,
and that fragment's inner update of the overlapped step is replaced by the outer result
(streaming DiLoCo's merge with ``alpha = 0``, torchft's ``fragment_update_alpha`` default).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed._compat import all_gather_single
from paratrain.parallel.options import DiLoCo
from paratrain.strategies.semisync.fragments import due
from paratrain.strategies.semisync.quantize import mean_of, pack

__all__ = ["Bucket", "OuterSync", "local_piece"]


def local_piece(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``tensor`` (a DTensor's local shard, shared storage)."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class Bucket:
    """Parameters of one fragment with one dtype and device, sent as one flat tensor."""

    def __init__(self, params: list[nn.Parameter]) -> None:
        self.params = params
        self.snapshot: torch.Tensor | None = None  # DiLoCo: s, flat
        self.momentum: torch.Tensor | None = None  # DiLoCo with momentum: m, flat

    def pieces(self) -> list[torch.Tensor]:
        return [local_piece(p).detach() for p in self.params]

    def flat(self) -> torch.Tensor:
        """A flat copy of this rank's pieces."""
        return torch.cat([piece.reshape(-1) for piece in self.pieces()])

    @torch.no_grad()
    def assign(self, flat: torch.Tensor) -> None:
        pieces = self.pieces()
        for piece, value in zip(pieces, flat.split([p.numel() for p in pieces])):
            piece.copy_(value.view_as(piece))


def _buckets(params: list[nn.Parameter]) -> list[Bucket]:
    kinds: dict[tuple[torch.dtype, torch.device], list[nn.Parameter]] = {}
    for p in params:
        piece = local_piece(p)
        kinds.setdefault((piece.dtype, piece.device), []).append(p)
    return [Bucket(group) for group in kinds.values()]


class OuterSync:
    """The outer state and step of one optimizer's parameters.

    Args:
        mode: the layout's ``LocalSGD`` or ``DiLoCo``.
        fragments: the parameters, one list per fragment (one fragment but for streaming
            DiLoCo), in the same order on every rank.
        group: the ``replicate`` process group (this rank's replicate peers).
        replicas: its size, R.
        device: where the all-reduce runs (the process's device).
        groups: under fault tolerance, the replica groups' quorum
            (:class:`~paratrain.fault_tolerance.rounds.OuterRounds`), which carries each
            sync instead of ``group``: a quorum, a sum over the groups in it, a vote.
    """

    def __init__(self, mode: Any, fragments: list[list[nn.Parameter]], *,
                 group: dist.ProcessGroup | None, replicas: int,
                 device: torch.device, groups: Any = None) -> None:
        self.mode = mode
        self.diloco = isinstance(mode, DiLoCo)
        self.fragments = [_buckets(params) for params in fragments]
        self.group, self.replicas, self.device = group, replicas, device
        self.groups = groups
        self.fresh: set[int] = set()
        """Fragments whose parameters this group took from a healing peer since their last
        sync: the group has no inner steps of its own to add to them (it sends zeros)."""
        self.steps = 0
        """Optimizer steps taken under semi-synchronous training (the schedule's clock)."""
        self.started = False
        self.pending: dict[int, list[torch.Tensor]] = {}
        """Fragments whose pseudo-gradient sum (int8: the gathered messages) is sent
        (overlap) or received, not applied."""
        self._works: dict[int, list[Any]] = {}
        self.outer_steps = 0
        """Outer steps (fragment syncs) applied so far in this process."""

    @property
    def every(self) -> int:
        return self.mode.every

    @property
    def num_fragments(self) -> int:
        return len(self.fragments)

    # -- the hooks around the inner optimizer step -------------------------------------
    def before_step(self) -> None:
        """Take the snapshot ``s`` before the first inner step (DiLoCo)."""
        if self.diloco and not self.started:
            for buckets in self.fragments:
                for bucket in buckets:
                    bucket.snapshot = bucket.flat()
        self.started = True

    def after_step(self) -> None:
        """After inner step ``n``: finish the fragments sent at ``n - 1`` (overlap), then
        synchronise those due at ``n``."""
        self.steps += 1
        for index in sorted(self.pending):
            self._finish(index)
        for index in range(self.num_fragments):
            if due(self.steps, fragment=index, every=self.every,
                   fragments=self.num_fragments):
                self._start(index)

    def join_sync(self) -> None:
        """Fault tolerant: a group that healed on joining (its state now a peer's, which is
        in the sync due after step ``steps``) takes part in that sync."""
        for index in range(self.num_fragments):
            if due(self.steps, fragment=index, every=self.every, fragments=self.num_fragments):
                self._sync_groups(index)

    def wait(self) -> None:
        """Complete the all-reduces in flight (kept pending: they apply at the next step)."""
        for index in list(self._works):
            for work in self._works.pop(index):
                work.wait()

    # -- one fragment -----------------------------------------------------------------
    @torch.no_grad()
    def _start(self, index: int) -> None:
        if self.groups is not None:
            self._sync_groups(index)
            return
        buckets = self.fragments[index]
        if not self.diloco:
            totals = [self._all_reduce(self._message(b, self.replicas), async_op=False)[0]
                      for b in buckets]
            self._assign_mean(index, totals, self.replicas)
            return
        overlap, comm, sends, works = self.mode.overlap, self.mode.comm_dtype, [], []
        for bucket in buckets:
            if comm == "int8":
                send, work = self._all_gather(pack(bucket.snapshot - bucket.flat()),
                                              async_op=overlap)
            else:
                send, work = self._all_reduce(self._message(bucket, self.replicas),
                                              async_op=overlap)
            sends.append(send)
            works.append(work)
        self.pending[index] = sends
        if overlap:
            self._works[index] = works
        else:
            self._finish(index)

    def _message(self, bucket: Bucket, replicas: int) -> torch.Tensor:
        """What ``bucket`` adds to a sum over ``replicas``: its parameters, or with bf16 its
        pseudo-gradient, divided first (exact for a power-of-two R) so the bf16 sum stays
        small."""
        value = bucket.flat()
        if getattr(self.mode, "comm_dtype", None) == "bf16":
            value = (bucket.snapshot - value).div_(replicas).to(torch.bfloat16)
        return value

    def _assign_mean(self, index: int, totals: list[torch.Tensor], count: int) -> None:
        """Local SGD's outer step: fragment ``index``'s parameters become their mean."""
        for bucket, total in zip(self.fragments[index], totals):
            bucket.assign(total.div_(count))
        self.outer_steps += 1

    def _all_reduce(self, tensor: torch.Tensor, *, async_op: bool) -> tuple[torch.Tensor, Any]:
        send = tensor.to(self.device)
        work = dist.all_reduce(send, group=self.group, async_op=async_op)
        return send, work

    def _all_gather(self, message: torch.Tensor, *, async_op: bool) -> tuple[torch.Tensor, Any]:
        send = message.to(self.device)
        gathered = send.new_empty(self.replicas * send.numel())
        return gathered, all_gather_single(gathered, send, self.group, async_op=async_op)

    @torch.no_grad()
    def _sync_groups(self, index: int) -> None:
        """Fragment ``index``'s sync across fault-tolerant replica groups: each group sends
        what it would over a process group (a fresh group zeros) and a 1 (fresh: 0), so the
        sum says how many groups sent; the mean is over those."""
        def messages(groups: int) -> list[torch.Tensor]:
            fresh = index in self.fresh
            sends = [self._message(bucket, groups) for bucket in self.fragments[index]]
            sends = [(value.zero_() if fresh else value).to(self.device) for value in sends]
            return [*sends, torch.tensor([0.0 if fresh else 1.0], device=self.device)]

        summed = self.groups.outer_round(self.steps, messages)
        if summed is None:  # not committed: the next sync covers both rounds
            return
        self.fresh.discard(index)  # the peer's progress is in the outer step now
        if not summed.sent:
            return
        if not self.diloco:
            self._assign_mean(index, summed.totals, summed.sent)
            return
        self.pending[index] = summed.totals
        self._finish(index, sent=summed.sent, groups=summed.groups)

    @torch.no_grad()
    def _finish(self, index: int, *, sent: int | None = None, groups: int | None = None) -> None:
        """Apply fragment ``index``'s outer step from its sums: over ``self.replicas``
        replicas, or (fault tolerant) over the ``sent`` of ``groups`` that sent."""
        replicas = self.replicas if sent is None else sent
        for work in self._works.pop(index, []):
            work.wait()
        mode = self.mode
        for bucket, total in zip(self.fragments[index], self.pending.pop(index)):
            snapshot, mu = bucket.snapshot, mode.outer_momentum
            total = total.to(snapshot.device)
            if mode.comm_dtype == "int8":
                pseudo = mean_of(total, replicas).to(snapshot.dtype)
                target = snapshot - pseudo
            elif mode.comm_dtype == "bf16":
                pseudo = total.to(snapshot.dtype)
                if groups is not None and groups != sent:  # each divided by all groups
                    pseudo.mul_(groups / sent)
                target = snapshot - pseudo
            else:
                target = total.div_(replicas)  # mean(x_i), as local SGD's
                pseudo = snapshot - target if mu > 0 else None
            extra = None
            if mu > 0:
                if bucket.momentum is None:
                    bucket.momentum = torch.zeros_like(snapshot)
                extra = None if mode.nesterov else bucket.momentum.clone()
                bucket.momentum.mul_(mu).add_(pseudo)
                extra = bucket.momentum if extra is None else extra
            snapshot.lerp_(target, mode.outer_lr)
            if extra is not None:
                snapshot.sub_(extra, alpha=mode.outer_lr * mu)
            bucket.assign(snapshot)
        self.outer_steps += 1

    # -- checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's outer state (local pieces): the clock, ``s``, ``m`` and the sums
        received but not yet applied (the in-flight ones are waited for first)."""
        self.wait()

        def each(attribute: str) -> list[list[torch.Tensor | None]]:
            return [[_copy(getattr(b, attribute)) for b in buckets] for buckets in self.fragments]

        return {"kind": type(self.mode).__name__, "every": self.every,
                "fragments": self.num_fragments, "steps": self.steps,
                "started": self.started, "snapshot": each("snapshot"),
                "momentum": each("momentum"),
                "pending": {index: [t.detach().cpu().clone() for t in sends]
                            for index, sends in self.pending.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps, self.started = int(state["steps"]), bool(state["started"])
        for buckets, snapshots, momenta in zip(self.fragments, state["snapshot"],
                                               state["momentum"]):
            for bucket, snapshot, momentum in zip(buckets, snapshots, momenta):
                device = local_piece(bucket.params[0]).device
                bucket.snapshot = None if snapshot is None else snapshot.to(device)
                bucket.momentum = None if momentum is None else momentum.to(device)
        self.pending = {int(index): [t.to(self.device) for t in sends]
                        for index, sends in state["pending"].items()}
        self._works = {}


def _copy(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else tensor.detach().cpu().clone()
