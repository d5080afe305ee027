"""Calibration for ``paratrain plan``: measure a real model once on this machine.

Returns the :class:`~paratrain.plan_types.ModelProfile` (parameters, activation bytes,
time per sample, backward share, layers) that the analytic model scales up.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from paratrain.plan_types import ModelProfile


def default_model() -> Any:
    """The small MNIST-sized ConvNet calibrated when no model is given (input 1x28x28)."""
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(1, 32, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(1600, 256), nn.ReLU(), nn.Linear(256, 10),
    )


def _default_loss(output: Any) -> Any:
    first = output[0] if isinstance(output, (tuple, list)) else output
    return first.float().sum()


def calibrate(
    model: Any, example_input: Any, loss_fn: Callable[[Any], Any] | None = None, *,
    repeats: int = 3,
) -> ModelProfile:
    """Measure a real ``torch.nn.Module`` on this CPU and return its :class:`ModelProfile`.

    ``example_input`` is one batch (a tensor, or a tuple of tensors passed positionally;
    the first dimension is the batch). ``loss_fn(output)`` must return a scalar; the
    default sums the (first) output. One untimed warm-up pass also counts activation
    bytes: every tensor autograd saves for backward, excluding parameters, each storage
    once. Then the median of ``repeats`` timed forward+backward passes gives the time per
    sample and the backward share. The model's ``.grad`` fields are cleared afterwards.
    """
    import torch

    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive integer, got {repeats!r}")
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    first = inputs[0] if inputs else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0 or first.shape[0] < 1:
        raise ValueError("example_input must be a batch tensor (or a tuple starting with one)")
    batch = int(first.shape[0])
    params = list(model.parameters())
    num_parameters = sum(p.numel() for p in params)
    if num_parameters == 0:
        raise ValueError("model has no parameters to train")
    param_bytes = sum(p.numel() * p.element_size() for p in params) / num_parameters
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    loss_fn = loss_fn or _default_loss
    saved: dict[int, int] = {}

    def pack(t: Any) -> Any:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # e.g. tensors without a plain storage
            return t
        ptr = storage.data_ptr()
        # Parameters (and views of them, such as weight.t()) are model state, not activations;
        # one storage saved by several ops is in memory once.
        if ptr and ptr not in param_storages:
            saved[ptr] = max(saved.get(ptr, 0), storage.nbytes())
        return t

    # Output bytes of each child of a Sequential: what a pipeline cut there would send.
    outputs: list[int] = []
    hooks = []
    if isinstance(model, torch.nn.Sequential):
        def record(module: Any, args: Any, output: Any) -> None:
            out = output[0] if isinstance(output, (tuple, list)) else output
            outputs.append(out.numel() * out.element_size() if isinstance(out, torch.Tensor) else 0)

        hooks = [child.register_forward_hook(record) for child in model.children()]

    fwd_times: list[float] = []
    total_times: list[float] = []
    with torch.enable_grad():
        for i in range(repeats + 1):
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            if i == 0:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = loss_fn(model(*inputs))
                for hook in hooks:
                    hook.remove()
            else:
                loss = loss_fn(model(*inputs))
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            if i > 0:  # pass 0 warms caches up and carries the hook overhead
                fwd_times.append(t1 - t0)
                total_times.append(t2 - t0)
    model.zero_grad(set_to_none=True)
    total = max(statistics.median(total_times), 1e-9)
    backward_fraction = min(1.0, max(0.0, 1 - statistics.median(fwd_times) / total))
    # Pipeline stages are cut between leaf modules that own parameters (Conv, Linear, ...).
    layers = sum(1 for m in model.modules()
                 if not list(m.children()) and any(True for _ in m.parameters(recurse=False)))
    chain = tuple((sum(p.numel() for p in child.parameters()), out / batch)
                  for child, out in zip(model.children(), outputs)) if hooks else ()
    chain_times = _child_times(model, inputs, repeats) if hooks else ()
    return ModelProfile(
        chain=chain, chain_times=tuple(t / batch for t in chain_times),
        num_parameters=num_parameters, param_bytes=param_bytes, grad_bytes=param_bytes,
        activation_bytes_per_sample=sum(saved.values()) / batch,
        compute_time_per_sample=total / batch, backward_fraction=backward_fraction,
        num_layers=max(1, layers),
    )


def _child_times(model: Any, inputs: tuple, repeats: int) -> tuple[float, ...]:
    """Forward + backward seconds of each child of a Sequential, fed its real input.

    Each child runs alone on the (detached) output of the one before, as a pipeline
    stage does; its input needs a gradient unless it is the model's input. The median of
    ``repeats`` timed passes after one warm-up.
    """
    import torch

    def fresh(value: Any, needs_grad: bool) -> Any:
        # A new non-leaf tensor per pass: in-place children (ReLU(inplace=True)) may
        # modify it, and the caller's example input stays untouched.
        if not isinstance(value, torch.Tensor):
            return value
        if needs_grad and value.is_floating_point():
            return value.detach().requires_grad_(True) + 0
        return value.detach().clone()

    times = []
    args = inputs
    with torch.enable_grad():
        for index, child in enumerate(model.children()):
            samples = []
            for i in range(repeats + 1):
                call = tuple(fresh(a, needs_grad=index > 0) for a in args)
                t0 = time.perf_counter()
                output = child(*call)
                first = output[0] if isinstance(output, (tuple, list)) else output
                if isinstance(first, torch.Tensor) and first.requires_grad:
                    first.backward(torch.ones_like(first))
                if i:
                    samples.append(time.perf_counter() - t0)
            times.append(statistics.median(samples))
            args = (output.detach() if isinstance(output, torch.Tensor) else output,)
    model.zero_grad(set_to_none=True)
    return tuple(times)
