"""Numeric precision as its own component: autocast, loss scaling, module and input casting."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.config import PRECISIONS

# float8: bfloat16 autocast around the float8 linears (see paratrain.float8).
_AUTOCAST_DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16,
                    "float8": torch.bfloat16}


class _StepThrough:
    """Looks like the optimizer to GradScaler but steps through the strategy.

    GradScaler.step() calls ``optimizer.step()`` itself when the gradients are
    finite; routing that call through ``step_fn`` keeps strategy-specific steps
    (e.g. a parameter server's) under the scaler's inf/nan check.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, step_fn: Callable[[], Any]) -> None:
        self._optimizer = optimizer
        self._step_fn = step_fn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step_fn()


def _cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a (nested) value to ``dtype``."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, dict):
        return {k: _cast_floating(v, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_cast_floating(v, dtype) for v in value)
    return value


class Precision:
    """Precision policy of a run.

    ``32``: float32 everywhere. ``bf16-mixed``: float32 weights, bfloat16 autocast
    in forward. ``16-mixed``: float16 autocast plus a GradScaler that skips steps
    whose gradients overflowed (its state is saved in checkpoints). ``bf16-true``:
    the module itself is cast to bfloat16, floating inputs are cast on the way in
    and outputs back to float32 on the way out. ``float8``: ``bf16-mixed`` plus the
    Linears converted to torchao's float8 training linears (:mod:`paratrain.float8`).

    Example:
        >>> precision = Precision("bf16-mixed", "cpu")
        >>> out = precision.forward(torch.nn.Linear(4, 2), torch.randn(3, 4))
        >>> out.dtype
        torch.bfloat16
    """

    def __init__(self, mode: str, device_type: str, *, tf32: bool = True) -> None:
        if mode not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {mode!r}")
        if mode == "float8":  # torchao and the GPU are checked here, at Run(...)
            from paratrain.float8 import check_available

            check_available(device_type)
        self.mode = mode
        self.device_type = device_type
        self.scaler = torch.amp.GradScaler(device_type) if mode == "16-mixed" else None
        # GradScaler tracks per-optimizer state by object identity, so unscale() and
        # step() must see the same proxy object.
        self._proxies: dict[int, _StepThrough] = {}
        self.skipped_steps = 0
        """Optimizer steps the scaler skipped because gradients held inf/nan."""
        self._matmul_before: str | None = None
        if tf32 and device_type == "cuda" and torch.get_float32_matmul_precision() == "highest":
            # float32 matmuls (a 32 run; the parts a mixed run keeps in float32) on the
            # TF32 tensor cores: 10 mantissa bits in the products, float32 sums. A
            # precision the user chose ("high", "medium") is left alone; close restores.
            self._matmul_before = "highest"
            torch.set_float32_matmul_precision("high")

    def restore(self) -> None:
        """Undo what the policy set process-wide (TF32 matmuls); called by ``run.close``."""
        if self._matmul_before is not None:
            torch.set_float32_matmul_precision(self._matmul_before)
            self._matmul_before = None

    def _proxy(self, optimizer: torch.optim.Optimizer) -> _StepThrough:
        if id(optimizer) not in self._proxies:
            self._proxies[id(optimizer)] = _StepThrough(optimizer, optimizer.step)
        return self._proxies[id(optimizer)]

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return _AUTOCAST_DTYPES.get(self.mode)

    def autocast(self) -> contextlib.AbstractContextManager:
        """Context for the forward pass (and the loss computed inside it)."""
        dtype = self.autocast_dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    def forward(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call a module's forward under this policy (autocast or true-half casting)."""
        if self.mode == "bf16-true":
            args, kwargs = _cast_floating((args, kwargs), torch.bfloat16)
            # Losses and metrics computed outside the model stay in float32.
            return _cast_floating(fn(*args, **kwargs), torch.float32)
        with self.autocast():
            return fn(*args, **kwargs)

    def convert_module(self, module: nn.Module, *, float8: Any = None,
                       strategy: Any = None) -> nn.Module:
        """``module`` as this policy trains it, before the strategy wraps it.

        ``float8``: the options of ``float8`` (:class:`paratrain.float8.Float8`, a dict or
        None); ``strategy``: the run's, whose layout decides float8 all-gather.
        """
        if float8 is not None and self.mode != "float8":
            raise ValueError(f"float8 options were given with precision {self.mode!r}; "
                             "use precision='float8' or drop float8")
        if self.mode == "float8":
            from paratrain.float8 import Float8, convert

            return convert(module, Float8.parse(float8), device_type=self.device_type,
                           strategy=strategy)
        if self.mode == "bf16-true":
            return module.to(torch.bfloat16)
        return module

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        # float16 gradients underflow without scaling; the scaler divides it out again.
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring gradients back to their true scale (needed before clipping)."""
        if self.scaler is not None:
            self.scaler.unscale_(self._proxy(optimizer))

    def step(self, optimizer: torch.optim.Optimizer, step_fn: Callable[[], Any]) -> bool:
        """Run ``step_fn`` unless the scaler found inf/nan gradients; return whether it ran."""
        if self.scaler is None:
            step_fn()
            return True
        proxy = self._proxy(optimizer)
        stepped: list[Any] = []
        proxy._step_fn = lambda: stepped.append(step_fn())
        # GradScaler.step unscales (unless done for clipping), checks every gradient
        # for inf/nan and calls proxy.step() only when all are finite. Under DDP the
        # gradients are already all-reduced, so every rank takes the same decision.
        self.scaler.step(proxy)
        self.scaler.update()
        if not stepped:
            self.skipped_steps += 1
        return bool(stepped)

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
