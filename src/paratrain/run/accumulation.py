"""The state the micro-steps of one optimizer step share, in one object.

:class:`StepState` is owned by the step (:mod:`paratrain.run.step`) and read by ``Run``
(``save()`` refuses mid-group, an epoch's end drops a partial group): the micro-step
index within the accumulation group, whether backward ran in it, the counts of summed
losses (``run.backward(loss, count=)``), the last gradient norm, and the no-sync
context. That context must cover forward *and* backward of every micro-step but the
last (DDP's ``no_sync`` and FSDP's ``set_requires_gradient_sync`` both mark the forward),
so it opens when such a micro-step's forward starts and closes after its backward: both
ends are here.

Example:
    >>> state = StepState(accumulate=2)
    >>> state.at_boundary(loader=None), state.advance(loader=None)
    (False, False)
    >>> state.at_boundary(loader=None)
    True
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from paratrain.losses import GlobalCount

__all__ = ["StepState"]


class StepState:
    """One accumulation group's shared state.

    Args:
        accumulate: micro-steps per optimizer step (``RunConfig.accumulate``).
    """

    def __init__(self, accumulate: int) -> None:
        self.accumulate = accumulate
        self.micro_step = 0
        """Micro-steps taken in the current group (0: at a group's start)."""
        self.backward_seen = False
        """Whether backward ran in the current group (a step without it is a misuse)."""
        self.counts = GlobalCount()
        """Counts of summed losses in the group (``run.backward(loss, count=)``)."""
        self.last_grad_norm: torch.Tensor | None = None
        """The global gradient norm before clipping at the last optimizer step."""
        self._no_sync: contextlib.ExitStack | None = None

    def at_boundary(self, loader: Any) -> bool:
        """Whether the current micro-step is the last of its group: ``accumulate`` taken,
        or the loader's last batch of the epoch (a partial group closes there)."""
        if (self.micro_step + 1) % self.accumulate == 0:
            return True
        return loader is not None and loader.batches_in_epoch >= len(loader)

    def advance(self, loader: Any) -> bool:
        """End a micro-step; True if it closed its group (the optimizer steps now)."""
        boundary = self.at_boundary(loader)
        self.micro_step += 1
        return boundary

    def saw_backward(self, count: Any) -> None:
        """A backward of this group (``count``: its summed loss's element count, or None)."""
        self.counts.add(count)
        self.backward_seen = True

    def open_no_sync(self, context: contextlib.AbstractContextManager) -> None:
        """Enter the strategy's no-sync ``context`` for this micro-step (forward start)."""
        self._no_sync = contextlib.ExitStack()
        self._no_sync.enter_context(context)

    @property
    def no_sync_open(self) -> bool:
        return self._no_sync is not None

    def close_no_sync(self) -> None:
        """Leave it (after the micro-step's backward)."""
        if self._no_sync is not None:
            self._no_sync.close()
            self._no_sync = None

    def group_done(self) -> None:
        """The optimizer stepped: a new group starts."""
        self.micro_step = 0
        self.backward_seen = False
        self.counts.reset()

    def abandon(self) -> bool:
        """Drop the group (the loop left the epoch mid-group); True if it was partial."""
        partial = self.micro_step > 0
        self.group_done()
        return partial
