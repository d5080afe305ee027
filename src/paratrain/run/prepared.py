"""Which optimizer and schedulers a step may drive: what ``run.prepare`` returned.

Strategies whose parameters become DTensors (``fsdp``, ``zero2``, ``tp``, ...) replace
the model's parameters and rebuild the optimizer over the new ones. The optimizer the
user built before ``prepare``, or a second one built over the old parameters, then
steps tensors nothing reads: training "works" and learns nothing. A scheduler given to
``prepare`` and also stepped by hand advances twice per optimizer step. Each is turned
into one line here (docs/reliability.md lists them).

Cost: an identity test per ``run.step`` for the optimizer ``prepare`` returned; any other
optimizer is checked once. A global optimizer-step pre-hook (public torch API) is
installed only when ``prepare`` replaced parameters, and removed at ``close``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook


class PreparedOptimizers:
    """What ``prepare`` returned and what it replaced; refuses stepping the wrong optimizer.

    Args:
        strategy_name: named in the messages (the strategy that replaced the parameters).
    """

    def __init__(self, strategy_name: str) -> None:
        self._strategy = strategy_name
        self._returned: list[torch.optim.Optimizer] = []
        self._rebuilt: weakref.WeakSet = weakref.WeakSet()  # given to prepare, replaced
        self._replaced: dict[int, weakref.ref] = {}  # parameters prepare replaced by new ones
        self._checked: weakref.WeakSet = weakref.WeakSet()  # other optimizers found fine
        self._hook: Any = None

    @staticmethod
    def parameters_of(model: nn.Module) -> dict[str, weakref.ref]:
        """The model's parameters by name before ``prepare`` (weak: no memory is kept)."""
        return {name: weakref.ref(p) for name, p in model.named_parameters()}

    def record(self, before: dict[str, weakref.ref], model: nn.Module,
               given: torch.optim.Optimizer | None,
               returned: torch.optim.Optimizer | None) -> None:
        """After ``prepare``: ``model`` unwrapped, the optimizer given and the one returned."""
        now = dict(model.named_parameters())
        for name, ref in before.items():
            old = ref()
            if old is not None and name in now and now[name] is not old:
                self._replaced[id(old)] = ref
        if returned is not None:
            self._returned.append(returned)
        if given is not None and returned is not given:
            self._rebuilt.add(given)
        if self._replaced and self._hook is None:
            self._hook = register_optimizer_step_pre_hook(self._on_step)

    def check_step(self, optimizer: torch.optim.Optimizer, models: Iterable[nn.Module]) -> None:
        """ValueError when ``run.step(optimizer)`` would not train the prepared model."""
        if self._known(optimizer):
            return
        if optimizer in self._rebuilt:
            raise ValueError(
                "run.step got the optimizer you built before prepare(), which strategy "
                f"{self._strategy!r} replaced, so stepping it would not train the prepared "
                "model; use the one prepare returned: "
                "model, optimizer = run.prepare(model, optimizer)")
        params = _params(optimizer)
        if self._all_replaced(params):
            raise ValueError(
                f"run.step got an optimizer over the parameters that strategy "
                f"{self._strategy!r} replaced in run.prepare(), so it would train nothing; "
                "pass it to run.prepare(model, optimizer), or build it after prepare from "
                "the prepared model's parameters")
        owned = {id(p) for model in models for p in model.parameters()}
        if params and not any(id(p) in owned for p in params):
            raise ValueError(
                "run.step got an optimizer none of whose parameters belong to a model "
                "passed to run.prepare(), so the run would neither sync nor save what it "
                "trains; build it from the model you prepare and pass both: "
                "model, optimizer = run.prepare(model, optimizer)")
        self._checked.add(optimizer)

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._returned.clear()

    def _known(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(optimizer is o for o in self._returned) or optimizer in self._checked

    def _all_replaced(self, params: list[torch.Tensor]) -> bool:
        return bool(params) and all(
            (ref := self._replaced.get(id(p))) is not None and ref() is p for p in params)

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        # Any optimizer.step() in the process while the run is open, also one by hand.
        if self._known(optimizer):
            return
        if optimizer in self._rebuilt or self._all_replaced(_params(optimizer)):
            raise RuntimeError(
                f"optimizer.step() on an optimizer over the parameters that strategy "
                f"{self._strategy!r} replaced in run.prepare() trains nothing; use the "
                "optimizer prepare returned, or build this one after prepare from the "
                "prepared model's parameters")
        self._checked.add(optimizer)


class SchedulerSteps:
    """Refuses a scheduler that ``run.step`` steps and the user steps too.

    ``run.step`` steps the schedulers given to ``prepare`` once per optimizer step; one
    also stepped by hand advances twice as fast (32 steps of schedule for 16). Its
    ``last_epoch`` is compared with what ``run.step`` left at the previous step.
    """

    def __init__(self) -> None:
        self._marks: dict[int, tuple[int, int]] = {}  # id -> (global step, last_epoch)

    def check(self, schedulers: Iterable[Any], global_step: int) -> None:
        """RuntimeError when a scheduler moved since ``run.step`` stepped it at the last step."""
        for scheduler in schedulers:
            mark, count = self._marks.get(id(scheduler)), getattr(scheduler, "last_epoch", None)
            if mark is not None and mark[0] == global_step and count != mark[1]:
                raise RuntimeError(
                    f"a scheduler passed to run.prepare() was also stepped outside run.step "
                    f"(its last_epoch went from {mark[1]} to {count} between two optimizer "
                    "steps); run.step already steps it once per optimizer step, so it would "
                    "advance twice as fast: remove your scheduler.step() call, or do not pass "
                    "the scheduler to run.prepare()")

    def stepped(self, schedulers: Iterable[Any], global_step: int) -> None:
        """Remember where ``run.step`` left each scheduler; ``global_step`` after the step."""
        for scheduler in schedulers:
            count = getattr(scheduler, "last_epoch", None)
            if isinstance(count, int):
                self._marks[id(scheduler)] = (global_step, count)


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
