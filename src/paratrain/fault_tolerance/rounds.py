"""Semi-synchronous training (LocalSGD, DiLoCo) across fault-tolerant replica groups.

Under ``paratrain launch --fault-tolerant`` with ``Parallel(semi_sync=...)``, the replica
groups are the replicas of the outer step: each group takes its ``H`` inner steps alone,
with no quorum, vote or collective across groups, and the groups meet only at each outer
sync, which :class:`OuterRounds` carries through torchft:

1. a quorum (a group that is behind, or has just restarted, heals from a live peer in
   it: weights, inner optimizer, outer state ``s`` and ``m``, data cursor, step);
2. one all-reduce (sum) of what each group sends over a process group without fault
   tolerance (its parameters, or bf16 pseudo-gradients), plus a 1, so that the sum counts
   the groups that sent; a group healed since the fragment's last sync has no inner
   steps of its own in it and sends zeros and a 0 (it would otherwise count its peer's
   twice), so the outer step is the survivors' own mean;
3. the vote: a sync whose all-reduce a dying group broke is taken again in a new quorum,
   at most :attr:`RETRIES` times; after that it is skipped and the next sync of that
   fragment covers both rounds (every group keeps its own inner progress).

A restarted group waits in its first quorum until the others reach their next sync
(the lighthouse does not form a quorum of a minority of the live groups), so
``quorum_timeout_s`` must outlast one outer round (``H`` inner steps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed import ReduceOp

from paratrain.data.loader import DataCursor
from paratrain.fault_tolerance.quorum import ReplicaQuorum

__all__ = ["OuterRounds", "RoundSums"]


class RoundSums(NamedTuple):
    """What one outer sync across the groups returned."""

    totals: list[torch.Tensor]
    """The groups' messages summed, in the order sent (the count left out)."""
    groups: int
    """Groups in the quorum."""
    sent: int
    """Groups that sent their own progress (the quorum less those just healed)."""


class OuterRounds(ReplicaQuorum):
    """A :class:`ReplicaQuorum` whose groups meet only at outer syncs (semi_sync)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._outer: Any = None
        self._formed = False  # a quorum formed (on joining) that the next sync uses
        self._in_round = False  # in outer_round: a snapshot taken now is mid-sync
        self._healed_into_round = False

    def attach(self, outer: Any) -> None:
        """The :class:`~paratrain.strategies.semisync.outer.OuterSync` these rounds carry:
        its state travels to a healing group with the rest."""
        self._outer = outer

    def notice(self) -> str:
        return f"{super().notice()}; the groups meet at outer syncs only (semi_sync)"

    # -- inner steps: each group alone ------------------------------------------------
    def average_gradients(self, models: list[nn.Module]) -> None:
        if self._manager is None:
            super().average_gradients(models)  # the one-line refusal outside run.epochs()

    def commit(self, step: int) -> bool:
        return True

    def next_step(self, step: int, cursor: DataCursor) -> None:
        return None

    # -- healing ----------------------------------------------------------------------
    def _snapshot(self) -> dict[str, Any]:
        return {**super()._snapshot(), "outer": self._outer.state_dict(),
                "in_round": self._in_round}

    def _load(self, received: dict[str, Any]) -> None:
        super()._load(received)
        self._outer.load_state_dict(received["outer"])
        self._healed_into_round = bool(received["in_round"])
        if self._healed_into_round:  # the peer's weights hold its inner steps, not ours
            self._outer.fresh = set(range(self._outer.num_fragments))

    def join(self, state: Any, precision: Any, cursor: Callable[[], DataCursor], *,
             restarted: bool = False) -> DataCursor | None:
        """The first quorum; a group healed into the others' sync takes part in it."""
        if self._outer is None:
            raise RuntimeError("semi_sync under fault tolerance needs the optimizer prepared "
                               "(run.prepare(model, optimizer)) before run.epochs()")
        if self._manager is not None:
            return None  # joined already (another run.epochs())
        self._healed_into_round = False
        healed = super().join(state, precision, cursor, restarted=restarted)
        if healed is not None and self._healed_into_round:
            self._formed = True
            self._outer.join_sync()
            # The peer is inside its optimizer step global_step + 1, which this sync ends
            # (its batch is behind the cursor): end it here as the peer's run.step does.
            for scheduler in state.schedulers:
                scheduler.step()
            state.global_step += 1
        else:
            # Every group starting together votes once on the start's quorum, as a step
            # would: torchft heals a group whose count of commits is 0 at every quorum
            # (init_sync), and the first outer sync must not take it for a new one. The
            # empty sum first: no group closes its state to a peer still healing from it.
            self._sum([torch.zeros(1, device=self._device)])
            self._manager.should_commit()
        return healed

    # -- one outer sync ---------------------------------------------------------------
    def outer_round(self, step: int,
                    messages: Callable[[int], list[torch.Tensor]]) -> RoundSums | None:
        """One sync after optimizer step ``step``: a quorum, the sum of
        ``messages(groups in the quorum)`` (its last tensor: 1 if this group sent its own
        progress, else 0) and the vote; None when no quorum committed it."""
        for attempt in range(1 + self.RETRIES):
            if not self._formed:
                self._in_round = True  # a peer healing in this quorum joins this sync
                try:
                    self._quorum(self._state.global_step)
                finally:
                    self._in_round = False
            self._formed = False
            groups = self._manager.num_participants()
            sends = messages(groups)
            if self._sum(sends) and self._manager.should_commit():
                *totals, count = sends
                sent = round(float(count.item()))
                if sent < groups:
                    self._print(f"fault tolerance: outer sync after step {step}: the mean of "
                                f"{sent} of {groups} replica groups ({groups - sent} healed "
                                "since its last sync, with no inner steps of its own)")
                return RoundSums(totals, groups, sent)
            again = "again in a new quorum" if attempt < self.RETRIES else (
                "skipped: the next sync covers both rounds")
            self._print(f"fault tolerance: the outer sync after step {step} failed in a quorum "
                        f"of {groups} replica group(s) (a group failed during it); {again}")
        self.uncommitted_steps.append(step)
        return None

    def _sum(self, tensors: list[torch.Tensor]) -> bool:
        """Sum ``tensors`` in place over the quorum's groups; False if a peer failed. All
        are sent before any is waited for: on a slow link the count costs no round trip
        of its own."""
        works = [self._manager.allreduce(t, reduce_op=ReduceOp.SUM) for t in tensors]
        for work in works:
            work.wait()
        return self._manager.errored() is None
