"""Loss spikes: a loss far above the recent ones stops, skips or warns (``RunConfig.spike``).

The rule: the loss of an optimizer step (the mean over the ranks that step together of
each rank's loss given to ``run.backward``, summed over the accumulation group as the
update weighs it) is a spike when it is above ``factor`` times the **largest** of the
last ``window`` losses kept. The detector arms once ``window`` losses are kept (the
warm-up) and only while that largest loss is positive (the rule is a ratio: it does not
apply to a loss that may be negative). Megatron flags a loss above 10x the largest seen;
Lightning's ``SpikeDetection`` compares with a running mean. A window's largest loss is
used here because it already holds the ordinary noise of the batches: a running mean
times a small factor fires on noisy but healthy batches, and the largest ever seen
(the first losses of a run) stops seeing anything once the loss has fallen.

The losses kept are those whose update was applied: a skipped spike does not raise the
bar for the next ones; a warned spike is kept (the run trained on it). Non-finite losses
are left to ``RunConfig.nan``.

Every rank holds the same window and reads the same gathered losses (the non-finite
guard's one small all-gather per optimizer step carries them), so every rank takes
the same decision. ``stop`` and ``skip`` decide before the update, so the loss is read on
the host once per optimizer step (on CUDA a device wait, as ``nan="skip"``'s).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.distributed.dtensor import local_piece
from paratrain.fieldtypes import check_types, from_fields

SPIKE_POLICIES = ("stop", "skip", "warn")

MAX_RECORDS = 100
"""Spikes kept in the run state (the first ones), as for non-finite batches."""


class LossSpikeError(RuntimeError):
    """A loss spike under ``Spike(policy="stop")`` (one line, printed as ``paratrain: ...``)."""


@dataclass(frozen=True, kw_only=True)
class Spike:
    """Options of ``Run(spike=...)``: this, a dict of its fields, True (the defaults) or
    None (no spike check).

    Example:
        >>> Spike.parse({"factor": 5}).factor
        5.0
    """

    factor: float = 3.0
    """A loss above ``factor`` times the largest of the last ``window`` losses is a spike
    (> 1)."""

    window: int = 50
    """How many recent losses the threshold is taken from; also the warm-up: no spike is
    flagged before this many losses are kept (>= 1)."""

    policy: str = "skip"
    """``stop`` (before the update, one line naming the step, the loss and the threshold),
    ``skip`` (the update is not applied: gradients zeroed, schedulers held, counted in
    ``skipped_steps``; 8 in a row stop) or ``warn`` (one line, training goes on)."""

    def __post_init__(self) -> None:
        check_types(Spike, {f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                    label=lambda name: f"spike.{name}")
        if not self.factor > 1:
            raise ValueError(f"spike.factor must be a number > 1, got {self.factor!r}")
        object.__setattr__(self, "factor", float(self.factor))
        if self.window < 1:
            raise ValueError(f"spike.window must be an integer >= 1, got {self.window!r}")
        if self.policy not in SPIKE_POLICIES:
            raise ValueError(f"spike.policy must be one of {SPIKE_POLICIES}, "
                             f"got {self.policy!r}")

    @classmethod
    def parse(cls, value: Any) -> Spike | None:
        """``value`` (None/False, True, a dict of the fields or a Spike) as a Spike or None;
        ValueError naming the bad field otherwise."""
        if value is None or value is False:
            return None
        if value is True:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"spike must be True, a dict such as {{'factor': 3, 'window': 50, "
                             f"'policy': 'skip'}}, a paratrain.run.spikes.Spike or None, "
                             f"got {value!r}")
        return from_fields(cls, value, name="spike")


def new_state() -> dict[str, list[Any]]:
    """The run state of the spike check (``RunState.loss_spikes``, saved in checkpoints):
    ``batches``, the spikes met (step, epoch, offset, loss, threshold, action), and
    ``window``, the recent losses the threshold is taken from."""
    return {"batches": [], "window": []}


def spike_guard(spike: Spike | None, state: dict[str, list[Any]],
                warn: Callable[[str], None]) -> SpikeGuard | None:
    """The check of ``RunConfig.spike`` (None when off)."""
    return None if spike is None else SpikeGuard(spike, state=state, warn=warn)


class SpikeGuard:
    """Keeps the window and decides on each optimizer step's loss (see the module docstring).

    Args:
        spike: the options.
        state: ``RunState.loss_spikes`` (:func:`new_state`): its lists are updated in place.
        warn: a rank-0 print for the warning line.
    """

    def __init__(self, spike: Spike, *, state: dict[str, list[Any]],
                 warn: Callable[[str], None]) -> None:
        self.spike = spike
        self.policy = spike.policy
        self._state = state
        self._warn = warn
        self._sum: torch.Tensor | None = None

    def saw_loss(self, loss: torch.Tensor) -> None:
        """Add ``loss`` (as given to backward, scaled for accumulation) on the device."""
        value = local_piece(loss.detach()).float().sum().reshape(1)
        self._sum = value if self._sum is None else self._sum + value

    def take_loss(self, device: torch.device) -> torch.Tensor:
        """This rank's loss of the group ending now (1 element; NaN when none was seen)."""
        total, self._sum = self._sum, None
        if total is None:  # a plain loss.backward(): nothing to compare
            return torch.full((1,), math.nan, device=device)
        return total.to(device)

    def threshold(self) -> float | None:
        """The bar a loss must stay under; None while warming up (or a loss <= 0)."""
        window = self._state["window"]
        if len(window) < self.spike.window:
            return None
        top = max(window)
        return top * self.spike.factor if top > 0 else None

    def check(self, step: int, batch: tuple[int, int] | None, losses: list[float],
              factor: float = 1.0) -> bool:
        """Decide on step ``step`` from every rank's loss (the same list on every rank);
        True when the update must be skipped. ``factor`` is what the gradients were
        multiplied by (a partial group, summed losses): the loss is scaled alike."""
        loss = math.fsum(losses) / len(losses) * factor
        if not math.isfinite(loss):
            return False  # RunConfig.nan's
        limit = self.threshold()
        if limit is None or loss <= limit:
            self._keep(loss)
            return False
        self._record(step, batch, loss, limit)
        line = (f"loss spike at step {step}: loss {loss:.6g} is above the threshold "
                f"{limit:.6g} ({self.spike.factor:g}x the largest of the last "
                f"{self.spike.window} losses; {batch_text(batch)})")
        if self.policy == "stop":
            raise LossSpikeError(
                f"{line}, so training stopped before that step's update; resume from the "
                "last checkpoint with a lower learning rate or that batch fixed, or pass "
                "Run(spike={\"policy\": \"skip\"}) to skip such steps")
        if self.policy == "warn":
            self._keep(loss)
            self._warn(f"paratrain: warning: {line}; training goes on (spike policy \"warn\")")
            return False
        return True

    def _keep(self, loss: float) -> None:
        window = self._state["window"]
        window.append(loss)
        del window[:-self.spike.window]

    def _record(self, step: int, batch: tuple[int, int] | None, loss: float,
                limit: float) -> None:
        records = self._state["batches"]
        if len(records) < MAX_RECORDS:
            records.append({"step": step, "epoch": batch[0] if batch else None,
                            "offset": batch[1] if batch else None, "loss": loss,
                            "threshold": limit, "action": self.policy})


def batch_text(batch: tuple[int, int] | None) -> str:
    if batch is None:
        return "batch: unknown, the data does not come from run.loader"
    return f"batch: epoch {batch[0]}, sample offset {batch[1]}"
