"""The judging half of ``model_layouts.py``: bounds, comparison and error lines.

A layout changes the order of float32 sums, nothing else; how far that may move losses
and parameters is :mod:`paratrain.testing.numerics`' bound (``TrainingBound`` replays
SGD on the one-process run). :class:`BufferBound` does the same for BatchNorm's running
statistics, which no optimizer touches.
"""

from __future__ import annotations

import os
import traceback
from functools import partial
from typing import Any

import torch
from torch import nn

import paratrain
from paratrain.testing.numerics import REASSOCIATION, U

_PARATRAIN = os.path.dirname(paratrain.__file__) + os.sep
_BATCHNORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)


class BufferBound:
    """Per-element bound on another layout's BatchNorm running statistics.

    Each training forward's batch mean is a sum reordered over the ranks: off by at most
    ``REASSOCIATION * M`` (``M`` the channel's largest ``|x|``, the terms' magnitude).
    The two-pass variance sums ``(x - mean)**2`` (terms up to ``(2M)**2``) with a mean
    off by that much: ``4 R M**2 + 2 * 2M * R M = 8 R M**2``, times Bessel's factor.
    The running averages carry ``(1 - momentum)`` of the previous bound, plus the
    update's own roundings. Attach to the reference model before training.
    """

    def __init__(self, model: nn.Module) -> None:
        self._bounds: dict[str, torch.Tensor] = {}
        for name, module in model.named_modules():
            if isinstance(module, _BATCHNORMS) and module.track_running_stats:
                module.register_forward_pre_hook(partial(self._before, name))

    def _before(self, name: str, module: nn.Module, args: tuple) -> None:
        if not module.training:
            return
        x = args[0].detach().double()
        dims = [d for d in range(x.dim()) if d != 1]
        largest = x.abs().amax(dims)
        count = x.numel() // x.shape[1]
        errors = {"running_mean": REASSOCIATION * largest,
                  "running_var": 8 * REASSOCIATION * largest ** 2 * count / max(count - 1, 1)}
        for buffer, error in errors.items():
            key = f"{name}.{buffer}" if name else buffer
            old = getattr(module, buffer).detach().double().abs()
            before = self._bounds.get(key, torch.zeros_like(old))
            if module.momentum is None:  # a cumulative average: a convex combination
                carried = torch.maximum(before, error)
            else:
                carried = (1 - module.momentum) * before + module.momentum * error
            # mul_ then add_: two roundings of values up to old + the new statistic.
            magnitude = old + (largest if buffer == "running_mean" else 4 * largest ** 2)
            self._bounds[key] = carried + 2 * U * magnitude

    def tolerances(self) -> dict[str, torch.Tensor]:
        """Buffer name -> per-element bound after the forwards seen."""
        return dict(self._bounds)


class RoundingPerturbation:
    """Moves every gradient by the rounding bound, with random signs, before each step.

    ``TrainingBound`` leaves out how an earlier step's parameter difference changes the
    next gradients (second order). For a BatchNorm network on 8 images that term
    dominates by the third step: statistics over 8 values per channel turn a 1e-6
    weight difference into a larger gradient difference. A second one-process run with
    this perturbation, each gradient element moved by ``REASSOCIATION`` times the
    step's largest gradient (what any layout's reordering may change it by, at most),
    measures that propagation on the model itself: the spread between the two runs.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)
        optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        size = REASSOCIATION * max(float(g.abs().max()) for g in grads)
        for grad in grads:
            signs = torch.randint(2, grad.shape, generator=self._generator) * 2 - 1
            grad.add_(signs.to(grad.dtype), alpha=size)


def spread(reference: dict, perturbed: dict) -> dict[str, Any]:
    """``{"state": {name: largest |difference|}, "losses": [|difference|]}`` of two runs.

    Per tensor, not per element: the propagation mixes a tensor's elements, so which
    ones a random perturbation moves most says nothing of another run's.
    """
    return {"state": {name: (value.double() - perturbed["state"][name].double()).abs().max()
                      for name, value in reference["state"].items()
                      if value.is_floating_point() and value.numel()},
            "losses": [abs(a - b) for a, b in zip(reference["losses"], perturbed["losses"])]}


def compare(results: list[dict], reference: dict) -> dict[str, Any]:
    """Every rank's losses and rank 0's gathered state against the one-process run.

    ``{"status": "ok" | "DIFFERS", "max": largest difference, "note": where}``.
    Entries no bound covers (``num_batches_tracked``, position ids) must be equal.
    With a ``spread`` (:class:`RoundingPerturbation`), each bound is at least twice it.
    """
    worst, over = 0.0, []
    measured = reference.get("spread") or {"state": {}, "losses": []}
    for rank, result in enumerate(results):
        for step, (got, want) in enumerate(zip(result["losses"], reference["losses"])):
            worst = max(worst, abs(got - want))
            propagated = 2 * measured["losses"][step] if measured["losses"] else 0.0
            if abs(got - want) > max(REASSOCIATION * abs(want), propagated):
                over.append(f"rank {rank} loss at step {step}: {got:.7g} vs {want:.7g}")
    state, want_state = results[0]["state"], reference["state"]
    aliases = reference["aliases"]
    bounds = {**reference["buffer_tolerances"], **reference["tolerances"]}
    missing = [k for k in want_state if k not in state and aliases.get(k, k) not in state]
    extra = [k for k in state if k not in want_state]
    if missing or extra:
        return {"status": "DIFFERS", "max": float("inf"),
                "note": f"state keys differ: missing {missing[:3]}, unexpected {extra[:3]}"}
    for name, value in state.items():
        want = want_state[name]
        if value.shape != want.shape:
            over.append(f"{name}: shape {tuple(value.shape)} vs {tuple(want.shape)}")
            continue
        diff = (value.double() - want.double()).abs()
        worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
        bound = bounds.get(aliases.get(name, name))
        if name in measured["state"]:
            bound = 2 * measured["state"][name] if bound is None else torch.maximum(
                bound, 2 * measured["state"][name])
        excess = diff - (bound if bound is not None else 0.0)
        if excess.numel() and float(excess.max()) > 0:
            over.append(f"{name}: differs by {float(diff.max()):.2g}, bound "
                        f"{float(bound.max()) if bound is not None else 0.0:.2g}")
    if over:
        return {"status": "DIFFERS", "max": worst,
                "note": f"{over[0]} ({len(over)} entries over their bound)"}
    return {"status": "ok", "max": worst}


def describe_error(exc: BaseException) -> dict[str, str]:
    """``refused`` for paratrain's one-line ValueError/RuntimeError, else ``FAILS`` with
    the error's first line and where it was raised (a raw torch error is a bug)."""
    frames = traceback.extract_tb(exc.__traceback__)
    origin = frames[-1] if frames else None
    message = str(exc).strip()
    first = message.splitlines()[0] if message else ""
    ours = origin is not None and origin.filename.startswith(_PARATRAIN)
    if ours and isinstance(exc, (ValueError, RuntimeError)) and "\n" not in message:
        return {"status": "refused", "line": message}
    where = ""
    if origin is not None:
        path = origin.filename
        for root in ("site-packages" + os.sep, "src" + os.sep):
            path = path.split(root, 1)[-1]
        where = f" (at {path}:{origin.lineno})"
    lines = "" if "\n" not in message else f" [{len(message.splitlines())}-line message]"
    return {"status": "FAILS", "line": f"{type(exc).__name__}: {first}{lines}{where}"}
