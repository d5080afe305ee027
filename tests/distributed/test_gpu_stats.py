"""CUDA measuring helpers: context before memory statistics, synchronised timing, NVML fallback.

The logic is checked on CPU with fakes; the ``gpu`` tests run on a machine with CUDA.
"""

from __future__ import annotations

import sys
import types

import torch

from paratrain.bench import measure as bench_measure
from paratrain.bench import worker as bench_worker
from paratrain.bench.measure import MemoryWatch, Utilisation
from paratrain.distributed import gpu_stats
from paratrain.distributed.gpu_stats import NVML_MISSING, GpuUtilisation, nvml_index, nvml_reader

CUDA0 = torch.device("cuda", 0)


def test_missing_pynvml_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes "import pynvml" raise ImportError
    assert nvml_reader(CUDA0) == (None, NVML_MISSING)
    util = GpuUtilisation(CUDA0)
    util.sample()
    assert util.mean() is None and util.unavailable == "n/a (install nvidia-ml-py)"


def test_cpu_has_no_gpu_reading_and_no_note():
    util = Utilisation(torch.device("cpu"))
    util.sample_gpu()
    util.accumulate()
    result = util.result()
    assert result["gpu_percent"] is None and result["gpu_note"] == ""


def fake_pynvml(handles: list[int], rates: list[float]) -> types.ModuleType:
    module = types.ModuleType("pynvml")
    module.nvmlInit = lambda: None
    module.nvmlDeviceGetHandleByIndex = lambda i: handles.append(i) or f"h{i}"
    module.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=rates.pop(0))
    return module


def test_nvml_reads_the_physical_gpu_behind_cuda_visible_devices(monkeypatch):
    handles: list[int] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(handles, [60.0, 80.0]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    util = GpuUtilisation(torch.device("cuda", 1))
    util.sample()
    util.sample()
    assert handles == [5] and util.mean() == 70.0 and util.unavailable == ""


def test_nvml_index_without_a_mask_is_the_cuda_index():
    assert nvml_index(torch.device("cuda", 2), environ={}) == 2
    assert nvml_index(torch.device("cuda", 0), environ={"CUDA_VISIBLE_DEVICES": "7"}) == 7


def test_nvml_failure_is_a_note_with_its_message(monkeypatch):
    module = fake_pynvml([], [])

    def refuse():
        raise RuntimeError("Driver Not Loaded")
    module.nvmlInit = refuse
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert nvml_reader(CUDA0) == (None, "n/a (NVML: Driver Not Loaded)")


def test_memory_watch_creates_the_cuda_context_before_resetting_stats(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "init", lambda: calls.append("init"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(f"set_device {d}"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda d=None: calls.append("sync"))
    monkeypatch.setattr(gpu_stats.torch, "empty",
                        lambda *a, device=None, **k: calls.append(f"alloc {device}"))

    def reset(device):
        # What the real call does without a context: "Invalid device argument".
        if "alloc cuda:0" not in calls:
            raise RuntimeError("Invalid device argument")
        calls.append("reset")
    monkeypatch.setattr(bench_measure.torch.cuda, "reset_peak_memory_stats", reset)
    monkeypatch.setattr(bench_measure.torch.cuda, "memory_allocated", lambda d: 512)
    watch = MemoryWatch(CUDA0)
    assert calls == ["init", "set_device cuda:0", "alloc cuda:0", "sync", "reset"]
    assert watch.baseline == 512


def test_optimizer_step_is_timed_between_synchronisations(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(gpu_stats, "synchronize", lambda device: calls.append(device.type))
    spec = bench_worker.JobSpec(strategy="single")
    seconds = bench_worker._timed_optimizer_step(torch.nn.Linear(3, 2), spec,
                                                 torch.device("cpu"), repeats=2)
    assert seconds >= 0 and calls == ["cpu"] * 6  # before and after each of 3 steps
