"""CUDA helpers for measuring: a live context before memory statistics, honest timing, and
GPU utilisation through NVML (the optional ``nvidia-ml-py`` package, imported as ``pynvml``).

Example::

    from paratrain.distributed.gpu_stats import GpuUtilisation, ensure_cuda_context, synchronize
    ensure_cuda_context(device)          # before torch.cuda.reset_peak_memory_stats(device)
    util = GpuUtilisation(device)
    synchronize(device); t0 = time.perf_counter(); ...; synchronize(device)
    util.sample(); util.mean(), util.unavailable   # e.g. (None, "n/a (install nvidia-ml-py)")
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import suppress

import torch

from paratrain.distributed import _compat

#: What a report shows for GPU utilisation when NVML's Python binding is not installed.
NVML_MISSING = "n/a (install nvidia-ml-py)"


def default_accelerator() -> str:
    """``"cuda"`` when a CUDA device is visible, else ``"cpu"``: what ``accelerator="auto"`` picks."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def ensure_cuda_context(device: torch.device) -> None:
    """Create the CUDA context and this device's caching allocator.

    ``torch.cuda.reset_peak_memory_stats`` and friends do not initialise CUDA themselves:
    called first thing in a process they fail with ``Invalid device argument``. A one-element
    allocation makes the allocator for ``device`` exist, so its statistics can be reset and read.
    No-op on CPU.
    """
    if device.type != "cuda":
        return
    torch.cuda.init()
    if device.index is not None:
        torch.cuda.set_device(device)
    torch.empty(1, device=device)
    torch.cuda.synchronize(device)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work: CUDA kernels run asynchronously, so a wall clock read
    without this measures how fast work was queued, not how fast it ran. No-op on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def nvml_index(device: torch.device, environ: dict[str, str] | None = None) -> int:
    """NVML numbers all GPUs of the machine; CUDA only the visible ones, in
    ``CUDA_VISIBLE_DEVICES`` order. Integer lists are mapped here; UUID lists through torch."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
    if not visible:
        return index
    items = [v.strip() for v in visible.split(",") if v.strip()]
    if all(v.isdigit() for v in items):
        return int(items[index])
    return _compat.nvml_device_index(device)  # UUIDs need NVML's own list


def nvml_reader(device: torch.device) -> tuple[Callable[[], float] | None, str]:
    """``(read, "")`` where ``read()`` is the device's utilisation in percent, or
    ``(None, why)``: not CUDA (``""``), ``pynvml`` missing, or NVML refusing (its message)."""
    if device.type != "cuda":
        return None, ""
    try:
        import pynvml
    except ImportError:
        return None, NVML_MISSING
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(nvml_index(device))
    except Exception as exc:  # noqa: BLE001 - any NVML failure: report it, keep measuring
        text = str(exc).strip().splitlines()
        return None, f"n/a (NVML: {text[0] if text else type(exc).__name__})"
    return (lambda: float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)), ""


class GpuUtilisation:
    """Samples of one device's utilisation (NVML's average over its last sample period,
    1/6 to 1 s): call :meth:`sample` inside timed windows, read :meth:`mean`.

    ``unavailable`` says why there are no samples on CUDA (e.g. :data:`NVML_MISSING`);
    it is ``""`` on CPU and when NVML answers.
    """

    def __init__(self, device: torch.device, *,
                 reader: tuple[Callable[[], float] | None, str] | None = None) -> None:
        self._read, self.unavailable = reader if reader is not None else nvml_reader(device)
        self.samples: list[float] = []

    def sample(self) -> None:
        if self._read is not None:
            with suppress(Exception):  # a failed reading is a missing sample, not an error
                self.samples.append(self._read())

    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None
