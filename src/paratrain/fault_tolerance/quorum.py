"""The replica axis of a fault-tolerant job, through torchft's ``Manager``.

One :class:`ReplicaQuorum` per rank. Each step consumes one quorum: the first is formed
when training starts (:meth:`join`, where a group that comes back heals from a live peer
and resumes at that peer's data cursor, as from a checkpoint), the next ones right after
each optimizer step (:meth:`next_step`). Between them the step's gradients are averaged
over the groups in the quorum (:meth:`average_gradients`) and the groups vote on the
update (:meth:`commit`): a group whose collective failed (a peer died mid-step) does not
apply it, and is healed from a peer at the next quorum. Quorums are synchronous
(``use_async_quorum=False``): a healed group computes its next gradients on the healed
weights, so every group in a quorum contributes.

Rank ``i`` of a group talks to rank ``i`` of the others (torchft's process group per
group rank), so any layout inside a group (one rank, DDP, FSDP: HSDP across groups)
averages its local gradients, or gradient shards, with its counterparts.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from paratrain.data.loader import DataCursor
from paratrain.fault_tolerance import heal
from paratrain.fault_tolerance.options import FaultTolerance, ReplicaGroup

__all__ = ["LighthouseUnreachable", "ReplicaQuorum"]


class LighthouseUnreachable(RuntimeError):
    """The first quorum failed: the lighthouse or the other groups cannot be reached."""


def _grads(models: list[nn.Module]) -> list[torch.Tensor]:
    grads = [p.grad for m in models for p in m.parameters() if p.grad is not None]
    return [g.to_local() if isinstance(g, DTensor) else g for g in grads]


class ReplicaQuorum:
    """This rank's view of the replica groups: quorum, gradient average, commit, heal."""

    def __init__(self, options: FaultTolerance, group: ReplicaGroup, *, rank: int,
                 world_size: int, device: torch.device, print_fn: Callable[[str], None]) -> None:
        self.options, self.group = options, group
        self._rank, self._world_size, self._device = rank, world_size, device
        self._print = print_fn
        self._manager: Any = None
        self._store: Any = None
        self._state: Any = None
        self._precision: Any = None
        self._cursor: Callable[[], DataCursor] | None = None
        self._healed: DataCursor | None = None
        self._caught_up = False  # healed mid-step: this step's update is the peer's already
        self._groups = 0  # groups in the last quorum, for the timeline
        self.uncommitted_steps: list[int] = []
        """Steps whose update no group applied here (a group failed during them)."""

    def data_shard(self, rank: int, size: int) -> tuple[int, int]:
        """The sampler's ``(rank, size)`` over all groups, from the group's own: group ``g``
        reads the ``g``-th share of every global batch, whichever groups are alive."""
        return self.group.index * size + rank, self.group.count * size

    def notice(self) -> str:
        return (f"fault tolerant: replica group {self.group.index} of {self.group.count}, "
                f"lighthouse {self.group.lighthouse}, at least {self.options.min_groups} "
                "group(s) per step")

    # -- the quorum -------------------------------------------------------------------
    def _create_manager(self) -> Any:
        from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL

        opts = self.options
        # torchft reads a healing peer's state from a read-only buffer; nothing writes it.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        where: dict[str, Any] = {}
        if self._world_size == 1:
            # A one-rank group has no process group, so no rendezvous store to share
            # with torchft (torchrun's agent keeps one only without --max-restarts).
            import torch.distributed as dist

            self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
            where = {"store_addr": "127.0.0.1", "store_port": self._store.port}
        pg_class = ProcessGroupNCCL if self._device.type == "cuda" else ProcessGroupGloo
        return Manager(
            pg=pg_class(timeout=timedelta(seconds=opts.collective_timeout_s)),
            load_state_dict=self._load, state_dict=self._snapshot,
            min_replica_size=opts.min_groups, use_async_quorum=False,
            timeout=timedelta(seconds=opts.step_timeout_s),
            quorum_timeout=timedelta(seconds=opts.quorum_timeout_s),
            connect_timeout=timedelta(seconds=opts.connect_timeout_s),
            rank=self._rank, world_size=self._world_size,
            lighthouse_addr=self.group.lighthouse,
            replica_id=f"paratrain_group_{self.group.index}", **where,
            init_sync=True)  # else a group restarted at step 0 would not heal

    def _snapshot(self) -> dict[str, Any]:
        return heal.snapshot(self._state, self._precision, self._cursor())

    def _load(self, received: dict[str, Any]) -> None:
        self._healed = heal.restore(self._state, self._precision, received)

    def _quorum(self, step: int) -> DataCursor | None:
        """Form the quorum of the next step; the cursor of a healing peer, if healed."""
        self._healed = None
        started = time.perf_counter()
        self._manager.start_quorum()
        groups = self._manager.num_participants()
        if groups != self._groups and self._groups:
            change = "left" if groups < self._groups else "joined"
            self._print(f"fault tolerance: step {step}: {abs(groups - self._groups)} replica "
                        f"group(s) {change}; {groups} of {self.group.count} in the quorum")
        self._groups = groups
        healed = self._healed
        if healed is not None and self._state.global_step > 0:  # step 0: the start's sync
            self._print(f"fault tolerance: replica group {self.group.index} healed from a live "
                        f"peer at step {self._state.global_step} (weights, optimizer, data "
                        f"cursor) in {time.perf_counter() - started:.2f} s")
        return healed

    def join(self, state: Any, precision: Any, cursor: Callable[[], DataCursor], *,
             restarted: bool = False) -> DataCursor | None:
        """The first quorum, when training starts: the data cursor to resume at if this
        group healed from a peer (it came back), else None.

        A job's first start waits (up to ``quorum_timeout_s``) until every group is in the
        quorum, so that no group trains ahead alone; a restarted group joins whatever
        quorum the others are in.
        """
        if self._manager is not None:
            return None
        self._state, self._precision, self._cursor = state, precision, cursor
        try:
            self._manager = self._create_manager()
            healed = self._quorum(state.global_step)
            deadline = time.monotonic() + self.options.quorum_timeout_s
            while (not restarted and self._groups < self.group.count
                   and time.monotonic() < deadline):
                healed = self._quorum(state.global_step) or healed
            return healed
        except (RuntimeError, TimeoutError) as exc:
            detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
            raise LighthouseUnreachable(
                f"replica group {self.group.index} could not join a quorum at the lighthouse "
                f"{self.group.lighthouse} within {self.options.quorum_timeout_s:g} s "
                f"({detail}); start the lighthouse (`paratrain launch --fault-tolerant` starts "
                "one) or pass its address with --lighthouse") from None

    def _average(self, grads: list[torch.Tensor]) -> bool:
        """One try at the average; the gradients are left as they were if it failed."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for grad in grads:
            by_dtype.setdefault(grad.dtype, []).append(grad)
        flats = []
        for group in by_dtype.values():  # one flat buffer per dtype: one collective each
            flat = torch.cat([g.reshape(-1) for g in group])
            self._manager.allreduce(flat).wait()
            flats.append((group, flat))
        if self._manager.errored() is not None:
            return False  # a peer died mid-collective: the buffers hold garbage
        for group, flat in flats:
            offset = 0
            for grad in group:
                grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
                offset += grad.numel()
        return True

    def average_gradients(self, models: list[nn.Module]) -> None:
        """Average this rank's gradients with its counterparts in the quorum's groups.

        When a group dies during the all-reduce, the survivors form a new quorum without
        it (once the lighthouse stops hearing from it) and average their own, intact
        gradients again: the step is not lost. A group found behind in that quorum heals
        instead, and the update of this step, already in its peer's state, is skipped.
        """
        if self._manager is None:
            raise RuntimeError("fault-tolerant training forms its first quorum in run.epochs(); "
                               "write the loop as `for epoch in run.epochs(N):`")
        self._caught_up = False
        grads = _grads(models)
        for attempt in range(1 + self.RETRIES):
            if attempt and self._quorum(self._state.global_step + 1) is not None:
                self._caught_up = True
                self._state.global_step -= 1  # the peer's count has this step; the loop adds it
                return
            if not grads or self._average(grads):
                return

    RETRIES = 2
    """New quorums a step tries after a failed all-reduce before it is skipped."""

    def commit(self, step: int) -> bool:
        """The groups' vote on applying this step's update; False: this group skips it."""
        if self._caught_up:
            self._print(f"fault tolerance: replica group {self.group.index} caught up with a "
                        f"live peer during step {step}; it keeps its data position")
            return False
        committed = bool(self._manager.should_commit())
        if not committed:
            self.uncommitted_steps.append(step)
            self._print(f"fault tolerance: step {step} not committed (a replica group failed "
                        "during it); its update is skipped here and the group heals if behind")
        return committed

    def next_step(self, step: int, cursor: DataCursor) -> None:
        """After-step hook: the quorum of the next step (a group behind heals here, keeping
        its own data position: its loader is already running). A group that caught up
        during the step is in the next step's quorum already: its peers wait in it."""
        if self._caught_up:
            self._caught_up = False
            return
        if self._quorum(step) is not None:
            self._print(f"fault tolerance: replica group {self.group.index} keeps its data "
                        f"position (epoch {cursor.epoch}, sample {cursor.offset})")

    def close(self) -> None:
        if self._manager is not None:
            self._manager.shutdown(wait=False)
            self._manager = None


