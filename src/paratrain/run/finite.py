"""The non-finite guard: a NaN/inf loss stops, skips or warns (``RunConfig.nan``).

Without it a non-finite loss trains on silently: under ``32`` one NaN turns every
parameter NaN and the run still exits 0; under ``16-mixed`` the loss scaler skips step
after step while the progress bar reads 100%.

What is checked: the loss given to ``run.backward`` (a plain ``loss.backward()`` is not
seen) and, with ``max_grad_norm``, the gradient norm the clipping computes anyway. No
other pass over the gradients is made, and no value is changed.

What it costs: one tiny kernel per micro-step on the device, and one small all-gather
per optimizer step among the ranks that step together (one code per rank also names the
ranks that saw it). ``skip`` decides before the update, so it reads the agreed flags
on the host at once: free on CPU (gloo's collective returns on the host), one device
wait per optimizer step on CUDA, like GradScaler's. Nothing cheaper decides before the
update: a step has no host read of its own to share (no ``item()``, the clipping keeps
its norm on the device) and ``optimizer.step`` cannot be made conditional on a device
flag in general (only torch's fused optimizers take one). ``stop`` decides before the
update where the read is free (CPU): the parameters are then those before the bad step.
On a GPU a wait per step would stop the host from queueing the next step while the
device works (a launch-bound model loses most of its speed), so there ``stop``, like
``warn``, reads its flags one optimizer step later (or before a checkpoint, at the end
of an epoch) from a copy made without waiting, and stops before the *next* update, its
line saying that the bad step's update was applied; ``nan="skip"`` is the exact choice
there, at one device wait per step.
Under a GradScaler (``16-mixed``) its own skips are counted instead: it already checks
every gradient and decides alike on every rank.

The loss-spike check (:mod:`paratrain.run.spikes`) rides on the same all-gather: each
rank's loss of the group goes with its code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.distributed.dtensor import local_piece
from paratrain.run.spikes import SpikeGuard
from paratrain.run.spikes import batch_text as _batch_text

MAX_SKIPS_IN_A_ROW = 8
"""Skipped optimizer steps in a row (``nan="skip"`` or the fp16 loss scaler) that stop
the run: no update for this long is not an occasional bad batch, nothing trains."""

MAX_RECORDS = 100
"""Non-finite batches kept in the run state (the first ones: under ``warn`` a NaN model
makes every later step non-finite, and a checkpoint must not grow with them)."""

_LOSS, _NORM = 1, 2  # bits of a rank's code: what it saw


class NonFiniteError(RuntimeError):
    """The run met a non-finite loss or gradient norm (one line, printed as ``paratrain: ...``)."""


@dataclass
class _Pending:
    """The agreed flags of one optimizer step, not read on the host yet."""

    step: int
    batch: tuple[int, int] | None  # (epoch, sample offset) of the group's first sample
    loss_factor: float
    flags: torch.Tensor  # every rank's row: code (and loss), a host copy on CUDA
    ready: Any  # CUDA event after the copy, or None


class FiniteGuard:
    """Checks each optimizer step's losses and acts on ``policy`` (see the module docstring).

    Args:
        policy: ``RunConfig.nan``: ``stop``, ``skip`` or ``warn``.
        agree: the strategy's ``agree_flags`` (the ranks that step together).
        rank: this process's global rank.
        device: where the flags live (the run's device).
        scaled: a GradScaler decides (``16-mixed``): count its skips instead.
        records: where non-finite batches are recorded (``RunState.nonfinite_batches``,
            saved in checkpoints).
        warn: a rank-0 print for the warning line.
        spikes: the loss-spike check (``RunConfig.spike``), or None.
    """

    def __init__(self, *, policy: str, agree: Callable[[torch.Tensor], torch.Tensor],
                 rank: int, device: torch.device, scaled: bool,
                 records: list[dict[str, Any]], warn: Callable[[str], None],
                 spikes: SpikeGuard | None = None) -> None:
        self.policy = policy
        self.spikes = spikes
        self.skipped_steps = 0
        """Optimizer steps without an update (``skip`` or the loss scaler), all epochs."""
        self._agree = agree
        self._rank = rank
        self._device = device
        self.host_reads_free = torch.device(device).type == "cpu"
        """Whether reading the agreed flags on the host costs no device wait (CPU):
        ``stop`` then decides before the update, else one step late."""
        self._scaled = scaled
        self._records = records
        self._warn = warn
        self._warned = False
        self._loss_ok: torch.Tensor | None = None
        self._norm_ok: torch.Tensor | None = None
        self._zero: torch.Tensor | None = None
        self._pending: _Pending | None = None
        self._in_a_row: list[tuple[int, tuple[int, int] | None]] = []
        self._epoch_skipped = 0
        self._last_end: tuple[int, int] | None = None
        self._last_batch: tuple[int, int] | None = None
        self._host: tuple[torch.Tensor, Any] | None = None
        self._skipping = False  # before_update's answer for the step being taken

    # -- during the accumulation group -------------------------------------------------
    def saw_loss(self, loss: torch.Tensor) -> None:
        """Note (on the device, no wait) whether ``loss`` is finite."""
        if self.spikes is not None:
            self.spikes.saw_loss(loss)
        if not self._scaled:
            ok = torch.isfinite(local_piece(loss.detach())).all()
            self._loss_ok = ok if self._loss_ok is None else self._loss_ok & ok

    def saw_grad_norm(self, norm: torch.Tensor) -> None:
        if not self._scaled:
            self._norm_ok = torch.isfinite(norm.detach())

    def _code(self) -> torch.Tensor:
        """This rank's code for the group (bits ``_LOSS``, ``_NORM``), a 1-element tensor."""
        loss_ok, norm_ok, self._loss_ok, self._norm_ok = self._loss_ok, self._norm_ok, None, None
        if loss_ok is None and norm_ok is None:  # a plain loss.backward(): nothing seen
            if self._zero is None:
                self._zero = torch.zeros(1, dtype=torch.uint8, device=self._device)
            return self._zero
        code = None if loss_ok is None else (~loss_ok).to(torch.uint8)  # _LOSS is 1
        if norm_ok is not None:
            norm = (~norm_ok).to(torch.uint8) * _NORM
            code = norm if code is None else code | norm
        return code.reshape(1)

    # -- at the optimizer step -----------------------------------------------------------
    def before_update(self, step: int, loader: Any, *, loss_factor: float = 1.0) -> bool:
        """Agree on this step's flags; stop (raise) or return True when its update must
        be skipped, before the update.

        ``step`` is the optimizer step being taken (1-based), ``loader`` the training
        loader (None when the data does not come from ``run.loader``), ``loss_factor``
        what the gradients were multiplied by (for the spike check's loss).
        """
        batch = self._batch(loader)
        spikes = self.spikes
        self._skipping = False
        if self._scaled and spikes is None:
            return False
        self.settle()  # the previous step's flags, under warn
        code = self._code()
        if spikes is not None:  # each rank's row: its code and its loss of the group
            code = torch.cat([code.float(), spikes.take_loss(code.device)])
        rows = self._agree(code).reshape(-1, code.numel())  # every rank calls it, seen or not
        late = self.policy == "warn" or (self.policy == "stop" and not self.host_reads_free)
        if late and (spikes is None or spikes.policy == "warn"):
            self._pending = _Pending(step, batch, loss_factor, *self._copy_to_host(rows))
            return False
        # stop and skip decide now, before the update: the one host read (a device wait
        # on CUDA, none on CPU).
        self._skipping = self._decide(step, batch, loss_factor, rows.cpu().tolist())
        return self._skipping

    def _decide(self, step: int, batch: tuple[int, int] | None, loss_factor: float,
                rows: list[list[float]], *, applied: bool = False) -> bool:
        """Act on one step's agreed rows; True when its update must be skipped."""
        bad = self._bad_rows([int(row[0]) for row in rows])
        if bad:
            self._record(step, batch, bad)
            where = f"{_describe(bad)} at step {step} on ranks {[r for _, r in bad]} " \
                    f"({_batch_text(batch)})"
            if self.policy == "stop" and applied:
                raise NonFiniteError(
                    f"{where}, so training stopped before the next update; that step's was "
                    "applied (on a GPU nan=\"stop\" reads its flags a step late so that no "
                    "step waits for the device; nan=\"skip\" decides before the update); "
                    "resume from the last checkpoint with a lower learning rate or that "
                    "batch fixed")
            if self.policy == "stop":
                raise NonFiniteError(
                    f"{where}, so training stopped before that step's update (the "
                    f"parameters are those after step {step - 1}); resume from the last "
                    "checkpoint with a lower learning rate or that batch fixed, or pass "
                    "Run(nan=\"skip\") to skip such steps")
            if self.policy == "skip":
                self._count_skip(step, batch, what=_describe(bad))
                return True
            if not self._warned:
                self._warned = True
                self._warn(f"paratrain: warning: {where}; training goes on (nan=\"warn\"), "
                           "the parameters may be non-finite now; this warning is shown once")
        if self.spikes is not None and self.spikes.check(
                step, batch, [row[1] for row in rows], loss_factor):
            self._count_skip(step, batch, what="loss spikes")
            return True
        if not self._scaled:  # under a scaler, after_update counts its skips in a row
            self._in_a_row.clear()
        return False

    def after_update(self, stepped: bool, step: int) -> None:
        """Under a GradScaler: count its skip; ``MAX_SKIPS_IN_A_ROW`` in a row stop."""
        if not self._scaled or self._skipping:  # a spike skip is counted already
            return
        if stepped:
            self._in_a_row.clear()
        else:
            self._count_skip(step, self._last_batch, scaler=True, what="the loss scaler "
                             "found inf/nan gradients (float16 overflow or a non-finite loss)")

    def settle(self) -> None:
        """Read the pending flags of ``warn`` (waiting for that step only) and warn on them.

        Called before the next update, before a checkpoint is written and at the end of
        an epoch; all ranks call it at the same points and read the same agreed flags.
        """
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.ready is not None:
            pending.ready.synchronize()
        # A host tensor, copied when that step's flags were agreed: reading it does not
        # wait for the device (``numpy`` is a view, unlike ``item``/``tolist``).
        self._decide(pending.step, pending.batch, pending.loss_factor,
                     pending.flags.numpy().tolist(), applied=True)

    def take_epoch_skipped(self) -> int:
        """Skipped steps since the last call (the ``skipped_steps`` of an epoch's stats)."""
        count, self._epoch_skipped = self._epoch_skipped, 0
        return count

    # -- internals -------------------------------------------------------------------------
    def _bad_rows(self, codes: list[int]) -> list[tuple[int, int]]:
        """(code, rank) of the ranks that saw a non-finite value. Row i is rank i, unless
        the strategy agrees on nothing (one row: this rank's own)."""
        ranks = [self._rank] if len(codes) == 1 else range(len(codes))
        return [(int(code), rank) for code, rank in zip(codes, ranks) if code]

    def _count_skip(self, step: int, batch: tuple[int, int] | None, *, what: str,
                    scaler: bool = False) -> None:
        self.skipped_steps += 1
        self._epoch_skipped += 1
        self._in_a_row.append((step, batch))
        if len(self._in_a_row) < MAX_SKIPS_IN_A_ROW:
            return
        first, (last, last_batch) = self._in_a_row[0][0], self._in_a_row[-1]
        line = (f"{len(self._in_a_row)} optimizer steps in a row were skipped (steps {first} to "
                f"{last}, the last at {_batch_text(last_batch)}): {what}, so nothing trains")
        if self.policy == "warn" and scaler:  # nan="warn" goes on; spike skips stop
            self._in_a_row.clear()
            self._warn(f"paratrain: warning: {line}; training goes on (nan=\"warn\")")
            return
        fix = ("check the loss and the data, lower the learning rate, or use precision "
               "\"bf16-mixed\"" if scaler else
               "check the loss and the data, or lower the learning rate")
        raise NonFiniteError(f"{line}; {fix}")

    def _record(self, step: int, batch: tuple[int, int] | None,
                bad: list[tuple[int, int]]) -> None:
        if len(self._records) >= MAX_RECORDS:
            return
        self._records.append({"step": step, "epoch": batch[0] if batch else None,
                              "offset": batch[1] if batch else None,
                              "ranks": [rank for _, rank in bad]})

    def _batch(self, loader: Any) -> tuple[int, int] | None:
        """(epoch, offset) of the first sample of the group ending now, remembered."""
        if loader is None:
            self._last_batch = None
            return None
        cursor, start = loader.cursor, loader.sampler.cursor.offset
        last = self._last_end
        if last is not None and last[0] == cursor.epoch and start <= last[1] <= cursor.offset:
            start = last[1]  # the previous group of this epoch ended here
        self._last_end = (cursor.epoch, cursor.offset)
        self._last_batch = (cursor.epoch, start)
        return self._last_batch

    def _copy_to_host(self, flags: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if flags.device.type == "cpu":
            return flags, None
        # One pinned buffer, reused: the previous step's copy was read in settle() first.
        if self._host is None or self._host[0].shape != flags.shape:
            self._host = (torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True),
                          torch.cuda.Event())
        buffer, event = self._host
        buffer.copy_(flags, non_blocking=True)
        event.record()
        return buffer, event


def _describe(bad: list[tuple[int, int]]) -> str:
    codes = 0
    for code, _ in bad:
        codes |= code
    kinds = [name for bit, name in ((_LOSS, "loss"), (_NORM, "gradient norm")) if codes & bit]
    return "non-finite " + " and ".join(kinds)
