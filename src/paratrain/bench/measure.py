"""What one rank of ``paratrain bench`` measures about itself: memory, state bytes, CPU/GPU use.

Kept apart from the timing loop (:mod:`paratrain.bench.worker`) so each measurement is
small and testable on its own.
"""

from __future__ import annotations

import os
import time
from contextlib import suppress
from dataclasses import dataclass

import psutil
import torch
from torch import nn

from paratrain.distributed.device import peak_memory_bytes
from paratrain.distributed.dtensor import local_piece
from paratrain.distributed.gpu_stats import GpuUtilisation, ensure_cuda_context

_CLEAR_REFS = "/proc/self/clear_refs"
_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int | None:
    with suppress(OSError):
        with open(_STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    return None


class MemoryWatch:
    """Peak memory of this process above a baseline taken at construction.

    CUDA: ``max_memory_allocated`` after ``reset_peak_memory_stats`` (the context and the
    device's caching allocator are created first: the reset fails without them). CPU on Linux: the
    kernel's resident high-water mark (``VmHWM``), reset through ``/proc/self/clear_refs``
    so the imports before the baseline do not count; elsewhere ``ru_maxrss``, which may
    include them.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.resettable = False
        if device.type == "cuda":
            ensure_cuda_context(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = int(torch.cuda.memory_allocated(device))
            return
        self.baseline = int(psutil.Process().memory_info().rss)
        with suppress(OSError):
            with open(_CLEAR_REFS, "w") as f:
                f.write("5")  # "5" resets the peak RSS to the current RSS (Linux >= 4.0)
            self.resettable = _status_kib("VmHWM") is not None

    def peak_bytes(self) -> int:
        """Peak bytes (CUDA allocated or CPU resident) since the baseline."""
        if self.device.type != "cuda" and self.resettable:
            return int(_status_kib("VmHWM") or 0) * 1024
        return peak_memory_bytes(self.device)

    def peak_above_baseline(self) -> int:
        return max(0, self.peak_bytes() - self.baseline)


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for ``tensor`` (the local shard of a DTensor)."""
    local = local_piece(tensor)
    return int(local.numel() * local.element_size())


@dataclass(frozen=True)
class StateBytes:
    """Bytes of parameters, gradients and optimizer state held by this rank."""

    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> StateBytes:
    """Count each storage once (DDP's bucket views alias the gradients)."""
    seen: set[tuple[int, int]] = set()

    def once(t: torch.Tensor) -> int:
        local = local_piece(t)
        key = (local.untyped_storage().data_ptr(), local.storage_offset())
        if local.numel() == 0 or key in seen:
            return 0
        seen.add(key)
        return tensor_bytes(local)

    params = list(model.parameters())
    param_bytes = sum(once(p) for p in params)
    grad_bytes = sum(once(p.grad) for p in params if p.grad is not None)
    opt_bytes = 0
    if optimizer is not None and hasattr(optimizer, "state"):
        for state in optimizer.state.values():
            opt_bytes += sum(once(v) for v in state.values()
                             if isinstance(v, torch.Tensor) and v.dim() > 0)
    return StateBytes(param_bytes, grad_bytes, opt_bytes)


class Utilisation:
    """CPU busy share over the timed windows: this process (top-style, 100 = one core) and
    the machine (0-100 over all cores); GPU utilisation on CUDA through NVML, or why not
    (``gpu_note``, e.g. "n/a (install nvidia-ml-py)").

    ``start()``/``accumulate()`` bracket each window; ``result()`` sums them.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._proc = psutil.Process()
        self._gpu = GpuUtilisation(device)
        self._wall = self._cpu = self._busy = self._total = 0.0
        self.start()

    def start(self) -> None:
        self._marks = (time.perf_counter(), sum(self._proc.cpu_times()[:2]), psutil.cpu_times())

    def accumulate(self) -> None:
        wall0, cpu0, sys0 = self._marks
        now = psutil.cpu_times()
        total = sum(now) - sum(sys0)
        idle = (now.idle - sys0.idle) + (getattr(now, "iowait", 0.0) - getattr(sys0, "iowait", 0.0))
        self._wall += time.perf_counter() - wall0
        self._cpu += sum(self._proc.cpu_times()[:2]) - cpu0
        self._busy += total - idle
        self._total += total

    def sample_gpu(self) -> None:
        """Call inside a window: NVML's utilisation is an average over the last second."""
        self._gpu.sample()

    def result(self) -> dict[str, float | str | None]:
        return {
            "cpu_percent": 100.0 * self._cpu / self._wall if self._wall > 0 else None,
            "system_cpu_percent": 100.0 * self._busy / self._total if self._total > 0 else None,
            "gpu_percent": self._gpu.mean(),
            "gpu_note": self._gpu.unavailable,
            "num_cpus": float(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                              else os.cpu_count() or 1),
        }
