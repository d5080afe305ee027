"""Where ``paratrain plan`` calibrates: device choice, a synchronized clock, device memory.

Calibration must run where the job would run: a GPU is ~100x faster than the CPU for a
ResNet, so a CPU calibration on a GPU box makes every prediction wrong by that factor.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

from paratrain.config import PRECISIONS

_AUTOCAST = {"bf16-mixed": "bfloat16", "16-mixed": "float16", "float8": "bfloat16"}


def select_device(requested: str | None = None) -> Any:
    """The ``torch.device`` to calibrate on: ``requested``, else CUDA when visible, else CPU.

    ``requested`` is ``"cpu"``, ``"cuda"`` or ``"cuda:N"``. Asking for CUDA where none is
    visible (or for an index past the last GPU) is a ValueError naming ``device``.
    """
    import torch

    if requested is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() \
            else torch.device("cpu")
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected cpu, cuda or cuda:N, got {requested!r}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"device: only cpu and cuda are supported, got {requested!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device: {requested!r} requested but no CUDA device is visible; "
                         "use --device cpu")
    count = torch.cuda.device_count()
    index = torch.cuda.current_device() if device.index is None else device.index
    if index >= count:
        raise ValueError(f"device: {requested!r} does not exist ({count} CUDA device(s) visible)")
    return torch.device("cuda", index)


def device_memory(device: Any) -> int | None:
    """Total memory of a CUDA device in bytes; None for the CPU (memory is then not checked)."""
    import torch

    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device.index or 0).total_memory)


def device_name(device: Any) -> str:
    """``"cpu"`` or the CUDA device's marketing name, e.g. "NVIDIA H100 80GB HBM3"."""
    import torch

    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device.index or 0).name)


def synchronizer(device: Any) -> Callable[[], None]:
    """What to call before reading the clock so queued device work is finished.

    CUDA kernels run asynchronously: without a synchronize, ``perf_counter`` after a
    backward measures only the time to enqueue the kernels (microseconds), not to run them.
    """
    import torch

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def make_clock(device: Any, *, sync: Callable[[], None] | None = None,
               timer: Callable[[], float] = time.perf_counter) -> Callable[[], float]:
    """A ``perf_counter`` that first waits for ``device``; wall time, as a training step sees it.

    Wall time (not CUDA events) on purpose: for small, launch-bound models the host's
    kernel launches are the step time, and events would only time the GPU's busy part.
    ``sync`` and ``timer`` replace :func:`synchronizer` and ``perf_counter`` (for tests).
    """
    wait = synchronizer(device) if sync is None else sync

    def now() -> float:
        wait()
        return timer()

    return now


def check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`paratrain.config.PRECISIONS`, else ValueError."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return precision


def autocast(precision: str, device: Any) -> contextlib.AbstractContextManager:
    """The autocast context a run with ``precision`` puts around forward (and the loss)."""
    import torch

    name = _AUTOCAST.get(precision)
    if name is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=getattr(torch, name))
