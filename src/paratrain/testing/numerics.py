"""How far two layouts' training may drift apart, derived from float32 arithmetic.

A layout (shards, tensor pieces, pipeline stages) changes the order of float32 sums,
never the value computed in exact arithmetic. Reordering a sum of ``n`` terms changes
it by at most ``n * u`` times the sum of the terms' magnitudes (``u = 2**-24``), and,
the roundings being independent, by more than ``lam * sqrt(n) * u`` times that sum
with probability below ``2 * exp(-lam**2 / 2)`` (Higham and Mary, 2019).
:data:`REASSOCIATION` takes n = 4096 (forward, backward and the sums over ranks and
micro-batches chain reductions of at most 64 terms, width or tokens, at most 64 deep
in the test models: their errors add up like one sum of 64 x 64 terms) and lam = 8
(below 1e-13 per element): 512 u, about 3e-5. The terms' magnitude is taken as the largest gradient
element of the step, over the whole model: a gradient whose terms cancel (a key
bias, exactly zero in exact arithmetic) still has terms that size, and the largest
gradient element is tens of times any one tensor's typical element here.

What the optimizer does with that difference is the optimizer's arithmetic, which
:class:`TrainingBound` replays on the reference run, per element and per step:

- SGD (momentum ``mu``): ``p -= lr * buf``, ``buf = mu * buf + g``; a gradient
  difference reaches the parameter once per step, scaled by lr.
- Adam/AdamW: ``p -= lr * m_hat / (sqrt(v_hat) + eps)``. The step ``d = m_hat /
  (sqrt(v_hat) + eps)`` depends on the gradients through ``|dd/dg_s| <= (a_s + C *
  sqrt(c_s)) / (sqrt(v_hat) + eps)`` (``a_s``, ``c_s`` the bias-corrected weights of
  step s in m_hat and v_hat, ``C = sqrt(sum a_s**2 / c_s)``, which also bounds ``|d|``). Adam divides by the
  element's own gradient size, so an element whose gradient is tiny (a key bias,
  whose exact gradient is zero) turns a rounding difference into an lr-sized
  parameter difference: its bound is then ``2 * C * lr`` per step, all that can be
  said. Elements with a real gradient keep a tight bound.

Left out, as second order: gradient differences caused by the parameters' own
differences from earlier steps (the Hessian times differences already this small).
Losses need no replay: cross entropy's sum has no cancellation, so two layouts'
losses differ by at most :data:`REASSOCIATION` relative; the parameters' differences
enter weighted by their gradients, which are small exactly where Adam amplifies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

U = 2.0 ** -24
"""float32's unit roundoff."""
REASSOCIATION = 8 * math.sqrt(4096) * U
"""Relative bound (~3e-5) on what reordering the test models' float32 sums changes."""


def _adam_weights(t: int, beta1: float, beta2: float) -> tuple[float, float]:
    """(K, C) for step t: sum_s |dd/dg_s| * (sqrt(v_hat) + eps) <= K, and |d| <= C."""
    a = [(1 - beta1) * beta1 ** (t - s) / (1 - beta1 ** t) for s in range(1, t + 1)]
    c = [(1 - beta2) * beta2 ** (t - s) / (1 - beta2 ** t) for s in range(1, t + 1)]
    spread = math.sqrt(sum(x * x / y for x, y in zip(a, c)))
    return sum(a) + spread * sum(math.sqrt(y) for y in c), spread


class TrainingBound:
    """Per-element bound on how far another layout's parameters may be from this run's.

    Attach it to the reference (single-process) optimizer before training; after
    training, :meth:`tolerances` maps each parameter name to a tensor of bounds.
    SGD (with or without momentum) and Adam/AdamW are modelled; others are refused.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if not isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)):
            raise ValueError(f"TrainingBound models SGD and Adam(W), not {type(optimizer).__name__}")
        for group in optimizer.param_groups:
            if group.get("amsgrad") or group.get("nesterov") or group.get("maximize") \
                    or group.get("dampening", 0):
                raise ValueError("TrainingBound does not model amsgrad, nesterov, maximize "
                                 "or dampening")
        self._names = {p: name for name, p in model.named_parameters()}
        self._drift: dict[str, torch.Tensor] = {}
        self._momentum: dict[str, torch.Tensor] = {}
        self._gradient_error = 0.0
        self.steps = 0
        optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        self.steps += 1
        grads = [p.grad for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        largest = max(float(g.abs().max()) for g in grads)
        # Adam's step t depends on every gradient so far: the largest bound so far.
        self._gradient_error = max(self._gradient_error, REASSOCIATION * largest)
        adam = not isinstance(optimizer, torch.optim.SGD)
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                name = self._names[p]
                drift = self._drift.get(name, torch.zeros_like(p, dtype=torch.float64))
                # SGD and Adam (not AdamW: decoupled) add weight_decay * p to the gradient.
                decoupled = group.get("decoupled_weight_decay",
                                      isinstance(optimizer, torch.optim.AdamW))
                decay = 0.0 if decoupled else group["weight_decay"]
                error = self._gradient_error + decay * drift
                if adam:
                    step = self._adam_step(optimizer.state[p], group, error)
                else:
                    step = self._momentum.get(name, 0) * group["momentum"] + error
                    self._momentum[name] = step
                # Rounding p - lr * step can land one ulp apart: 2 roundings per step.
                self._drift[name] = (drift + group["lr"] * step
                                     + 2 * U * p.detach().abs().double())

    def _adam_step(self, state: dict, group: dict, error: torch.Tensor) -> torch.Tensor:
        t = int(state["step"])
        beta1, beta2 = group["betas"]
        k, c = _adam_weights(t, beta1, beta2)
        scale = (state["exp_avg_sq"].double() / (1 - beta2 ** t)).sqrt()
        # Mean value theorem: the other run's sqrt(v_hat) is at least this one's
        # minus the gradient bound (the weights c_s sum to 1).
        slope = k * error / ((scale - error).clamp_min(0) + group["eps"])
        return slope.clamp_max(2 * c)

    def tolerances(self) -> dict[str, torch.Tensor]:
        """Name -> per-element bound on |other - reference| after the steps taken."""
        return dict(self._drift)


def assert_params_within(got: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor],
                         bound: TrainingBound | Mapping[str, torch.Tensor],
                         what: str = "") -> None:
    """Every entry of ``got`` (a subset of ``reference``) within ``bound``'s tolerance
    (or within ``bound.tolerances()`` carried back from another process).

    Entries the bound does not know (buffers, never trained) must be equal bitwise.
    """
    tolerances = bound.tolerances() if isinstance(bound, TrainingBound) else bound
    assert tolerances, "the reference took no optimizer step: nothing bounds the drift"
    for name, value in got.items():
        ref = reference[name]
        if name not in tolerances:
            assert torch.equal(value, ref), f"{what}{name}: untrained entry differs"
            continue
        excess = (value.double() - ref.double()).abs() - tolerances[name]
        worst = int(excess.argmax())
        assert float(excess.flatten()[worst]) <= 0, (
            f"{what}{name}[{worst}]: {float(value.flatten()[worst])} vs "
            f"{float(ref.flatten()[worst])}, bound {float(tolerances[name].flatten()[worst]):.3g}")


def assert_gradients_within(got: Mapping[str, torch.Tensor],
                            reference: Mapping[str, torch.Tensor]) -> None:
    """Gradients of one backward within :data:`REASSOCIATION` times the reference's
    largest gradient element (the terms' magnitude: see the module docstring)."""
    scale = max(float(g.abs().max()) for g in reference.values())
    for name, value in got.items():
        error = float((value.double() - reference[name].double()).abs().max())
        assert error <= REASSOCIATION * scale, (
            f"{name}: gradient differs by {error:.3g}, bound {REASSOCIATION * scale:.3g}")


def assert_losses_within(got: Sequence[float], reference: Sequence[float]) -> None:
    """Per-step losses within :data:`REASSOCIATION` of the reference's, relative."""
    assert len(got) == len(reference)
    for step, (a, b) in enumerate(zip(got, reference)):
        assert abs(a - b) <= REASSOCIATION * abs(b), f"step {step}: loss {a} vs {b}"
