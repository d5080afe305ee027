"""Calibration for ``paratrain plan``: measure a real model once on this machine.

Returns the :class:`~paratrain.plan.types.ModelProfile` (parameters, activation bytes,
time per sample, backward share, layers) that the analytic model scales up.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from copy import deepcopy as copy_module
from typing import Any

from paratrain.plan.device import autocast, check_precision, make_clock, select_device
from paratrain.plan.tensor import tensor_parallel_fields
from paratrain.plan.types import ModelProfile

#: Optimizers whose step :func:`calibrate` can time.
_OPTIMIZERS = ("adam", "sgd")


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
    repeats: int = 3, warmup: int = 2, device: Any = None, precision: str = "32",
    optimizer: str | None = None, back_to_back: bool | None = None,
) -> ModelProfile:
    """Measure a real ``torch.nn.Module`` where it would train and return its :class:`ModelProfile`.

    ``example_input`` is one batch (a tensor, or a tuple of tensors passed positionally;
    the first dimension is the batch). ``loss_fn(output)`` must return a scalar; the
    default sums the (first) output. ``device``: a ``torch.device`` or string; None picks
    CUDA when visible, else the CPU (:func:`paratrain.plan.device.select_device`). On
    another device than the model's, or with ``precision="bf16-true"``, a copy of the
    model is measured; the caller's model and input are never changed. ``precision`` is
    one of :data:`paratrain.config.PRECISIONS`: the mixed ones autocast forward and loss.

    ``warmup`` untimed passes come first (the first also counts activation bytes: every
    tensor autograd saves for backward, excluding parameters, each storage once; CUDA
    needs the others for its lazy initialisation, cuDNN algorithm choice and caching
    allocator). Then the median of ``repeats`` timed forward+backward passes gives the
    time per sample and the backward share, each read after a device synchronize.
    ``back_to_back`` (default: on CUDA only) then times the passes as a training loop runs
    them, ``repeats`` of them between two synchronizes, and that gives the time per
    sample: the host queues a pass while the device still runs the one before, which
    a synchronize around every pass (forward and backward apart) would serialise. On
    the CPU both are the same. ``optimizer`` ("adam" or "sgd"): also time one optimizer
    step on copies of the parameters (``optimizer_step_time``; back to back as well).
    The model's ``.grad`` fields are cleared afterwards.
    A model with transformer blocks the ``tp`` strategy can split also gets the ``tp_*``
    fields (:func:`paratrain.plan.tensor.tensor_parallel_fields`, ``repeats`` more forwards).
    """
    import torch

    for name, value, low in (("repeats", repeats, 1), ("warmup", warmup, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    if optimizer not in (None, *_OPTIMIZERS):
        raise ValueError(f"optimizer must be None or one of {', '.join(_OPTIMIZERS)}, "
                         f"got {optimizer!r}")
    check_precision(precision)
    device = select_device(None if device is None else str(device))
    inputs = tuple(example_input) if isinstance(example_input, (tuple, list)) else (example_input,)
    first = inputs[0] if inputs else None
    if not isinstance(first, torch.Tensor) or first.dim() == 0 or first.shape[0] < 1:
        raise ValueError("example_input must be a batch tensor (or a tuple starting with one)")
    batch = int(first.shape[0])
    if not any(True for _ in model.parameters()):
        raise ValueError("model has no parameters to train")
    model = _placed(model, device, precision)
    true_dtype = torch.bfloat16 if precision == "bf16-true" else None
    inputs = tuple(_moved(a, device, true_dtype) for a in inputs)
    params = list(model.parameters())
    num_parameters = sum(p.numel() for p in params)
    param_bytes = sum(p.numel() * p.element_size() for p in params) / num_parameters
    param_storages = {p.untyped_storage().data_ptr() for p in params}
    loss_fn = loss_fn or _default_loss
    now = make_clock(device)
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

    def forward() -> Any:
        with autocast(precision, device):
            return loss_fn(model(*inputs))

    fwd_times: list[float] = []
    total_times: list[float] = []
    with torch.enable_grad():
        for i in range(warmup + repeats):
            model.zero_grad(set_to_none=True)
            t0 = now()
            if i == 0:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    loss = forward()
                for hook in hooks:
                    hook.remove()
            else:
                loss = forward()
            t1 = now()
            loss.backward()
            t2 = now()
            if i >= warmup:  # the first passes warm caches up; pass 0 carries the hook overhead
                fwd_times.append(t1 - t0)
                total_times.append(t2 - t0)
    if back_to_back is None:
        back_to_back = device.type == "cuda"
    opt_time = _optimizer_step_time(params, optimizer, now, warmup, repeats,
                                    back_to_back=back_to_back) if optimizer else 0.0
    total = max(statistics.median(total_times), 1e-9)
    backward_fraction = min(1.0, max(0.0, 1 - statistics.median(fwd_times) / total))
    if back_to_back:
        total = max(_back_to_back(model, forward, now, repeats), 1e-9)
    model.zero_grad(set_to_none=True)
    # Pipeline stages are cut between leaf modules that own parameters (Conv, Linear, ...).
    layers = sum(1 for m in model.modules()
                 if not list(m.children()) and any(True for _ in m.parameters(recurse=False)))
    chain = tuple((sum(p.numel() for p in child.parameters()), out / batch)
                  for child, out in zip(model.children(), outputs)) if hooks else ()
    chain_times = _child_times(model, inputs, repeats=repeats, warmup=warmup, now=now,
                               precision=precision, device=device) if hooks else ()
    tensor = tensor_parallel_fields(model, forward, batch=batch, now=now, repeats=repeats)
    return ModelProfile(
        chain=chain, chain_times=tuple(t / batch for t in chain_times),
        num_parameters=num_parameters, param_bytes=param_bytes, grad_bytes=param_bytes,
        activation_bytes_per_sample=sum(saved.values()) / batch,
        compute_time_per_sample=total / batch, backward_fraction=backward_fraction,
        num_layers=max(1, layers), optimizer_step_time=opt_time, **tensor,
    )


def _placed(model: Any, device: Any, precision: str) -> Any:
    """``model`` itself when it already lives on ``device`` in its dtype, else a moved copy."""
    import torch

    param = next(model.parameters())
    if param.device == device and precision != "bf16-true":
        return model
    copy = copy_module(model).to(device)
    return copy.to(torch.bfloat16) if precision == "bf16-true" else copy


def _moved(value: Any, device: Any, dtype: Any) -> Any:
    import torch

    if not isinstance(value, torch.Tensor):
        return value
    value = value.to(device)
    return value.to(dtype) if dtype is not None and value.is_floating_point() else value


def _back_to_back(model: Any, forward: Callable[[], Any], now: Callable[[], float],
                  passes: int) -> float:
    """Seconds per forward+backward pass, ``passes`` of them between two clock reads
    (each read synchronizes): what a training loop's step computes in."""
    import torch

    with torch.enable_grad():
        t0 = now()
        for _ in range(passes):
            model.zero_grad(set_to_none=True)
            forward().backward()
        return (now() - t0) / passes


def _optimizer_step_time(params: list, name: str, now: Callable[[], float], warmup: int,
                         repeats: int, *, back_to_back: bool = False) -> float:
    """Median seconds of one optimizer step on copies of ``params`` (their grads included),
    so the measured model's parameters stay exactly as they were; ``back_to_back``: the
    mean of ``repeats`` steps between two clock reads instead."""
    import torch

    copies = []
    for p in params:
        c = p.detach().clone().requires_grad_(True)
        c.grad = torch.zeros_like(c) if p.grad is None else p.grad.detach().clone()
        copies.append(c)
    opt = torch.optim.Adam(copies, lr=1e-3) if name == "adam" else \
        torch.optim.SGD(copies, lr=1e-3, momentum=0.9)
    samples = []
    for i in range(warmup + (0 if back_to_back else repeats)):
        t0 = now()
        opt.step()
        t1 = now()
        if i >= warmup:
            samples.append(t1 - t0)
    if back_to_back:
        t0 = now()
        for _ in range(repeats):
            opt.step()
        return (now() - t0) / repeats
    return statistics.median(samples)


def _child_times(model: Any, inputs: tuple, *, repeats: int, warmup: int,
                 now: Callable[[], float], precision: str, device: Any) -> tuple[float, ...]:
    """Forward + backward seconds of each child of a Sequential, fed its real input.

    Each child runs alone on the (detached) output of the one before, as a pipeline
    stage does; its input needs a gradient unless it is the model's input. The median of
    ``repeats`` timed passes after ``warmup`` untimed ones, read with the synchronized clock.
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
            for i in range(warmup + repeats):
                call = tuple(fresh(a, needs_grad=index > 0) for a in args)
                t0 = now()
                with autocast(precision, device):
                    output = child(*call)
                first = output[0] if isinstance(output, (tuple, list)) else output
                if isinstance(first, torch.Tensor) and first.requires_grad:
                    first.backward(torch.ones_like(first))
                t1 = now()
                if i >= warmup:
                    samples.append(t1 - t0)
            times.append(statistics.median(samples))
            args = (output.detach() if isinstance(output, torch.Tensor) else output,)
    model.zero_grad(set_to_none=True)
    return tuple(times)
