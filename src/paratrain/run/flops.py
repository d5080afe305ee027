"""Model FLOPs utilisation: FLOPs counted once on the first step, a table of device peaks.

MFU is the model's useful FLOP/s divided by what the device can do at its
dense peak for the run's precision. The model's FLOPs are counted by
``torch.utils.flop_counter.FlopCounterMode`` during the first training
micro-step (compiled graphs by :mod:`paratrain.flop_counter`) (every forward before the first ``run.backward`` and that backward),
so nothing is computed twice and no random numbers are drawn for it.

Example:
    >>> peak_flops_for("NVIDIA H100 80GB HBM3", "bf16")
    989500000000000.0
    >>> Throughput(tokens_per_sample=None, peak_flops=100e12, flops_per_sample=3e9,
    ...            replicas=1).rates(10_000)["mfu"]
    0.3
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.distributed import _compat
from paratrain.flop_counter import StepFlopCounter

T = 1e12

# Dense (no structured sparsity) peak FLOP/s per device. Vendor datasheets quote
# Hopper/Ada tensor rates "with sparsity"; those are halved here. Sources are
# listed in docs/throughput.md. Order matters: the first matching pattern wins.
_PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    (r"H100.*NVL", "H100 NVL", {"bf16": 835.5 * T, "fp16": 835.5 * T, "tf32": 417.5 * T,
                                "fp32": 60 * T}),
    (r"H100.*(PCIe|HBM2e)", "H100 PCIe", {"bf16": 756.5 * T, "fp16": 756.5 * T,
                                          "tf32": 378 * T, "fp32": 51 * T}),
    (r"H100", "H100 SXM", {"bf16": 989.5 * T, "fp16": 989.5 * T, "tf32": 494.5 * T,
                           "fp32": 67 * T}),
    (r"H200.*NVL", "H200 NVL", {"bf16": 835.5 * T, "fp16": 835.5 * T, "tf32": 417.5 * T,
                                "fp32": 60 * T}),
    (r"H200", "H200 SXM", {"bf16": 989.5 * T, "fp16": 989.5 * T, "tf32": 494.5 * T,
                           "fp32": 67 * T}),
    # 40 GB and 80 GB, SXM and PCIe share the same rates.
    (r"A100", "A100", {"bf16": 312 * T, "fp16": 312 * T, "tf32": 156 * T, "fp32": 19.5 * T}),
    # AWS's variant of the A10; NVIDIA publishes the A10 datasheet only.
    (r"A10G", "A10G", {"bf16": 125 * T, "fp16": 125 * T, "tf32": 62.5 * T, "fp32": 31.2 * T}),
    (r"L40S", "L40S", {"bf16": 362.05 * T, "fp16": 362.05 * T, "tf32": 183 * T,
                       "fp32": 91.6 * T}),
    (r"\bL4\b", "L4", {"bf16": 121 * T, "fp16": 121 * T, "tf32": 60 * T, "fp32": 30.3 * T}),
    # Volta and Turing have no bf16 or tf32 tensor cores: bf16 is n/a, tf32 runs as fp32.
    (r"V100S", "V100S PCIe", {"fp16": 130 * T, "fp32": 16.4 * T}),
    (r"V100.*SXM", "V100 SXM2", {"fp16": 125 * T, "fp32": 15.7 * T}),
    (r"V100", "V100 PCIe", {"fp16": 112 * T, "fp32": 14 * T}),
    (r"\bT4\b", "T4", {"fp16": 65 * T, "fp32": 8.1 * T}),
    # GeForce rates with FP32 accumulate (what PyTorch's fp16/bf16 GEMMs use).
    (r"RTX 4090(?! D)", "RTX 4090", {"bf16": 165.2 * T, "fp16": 165.2 * T, "tf32": 82.6 * T,
                                     "fp32": 82.6 * T}),
    (r"RTX 3090(?! Ti)", "RTX 3090", {"bf16": 71 * T, "fp16": 71 * T, "tf32": 35.6 * T,
                                      "fp32": 35.6 * T}),
)


def match_device(device_name: str) -> str | None:
    """The table's name for ``device_name`` (``torch.cuda.get_device_name()``), or None."""
    for pattern, label, _ in _PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return label
    return None


def peak_flops_for(device_name: str, dtype: str) -> float | None:
    """Dense peak FLOP/s of ``device_name`` for ``dtype`` (bf16, fp16, tf32, fp32), or None."""
    for pattern, _, peaks in _PEAKS:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            if dtype == "tf32" and "tf32" not in peaks:
                return peaks["fp32"]  # no TF32 units: fp32 matmuls run at the fp32 rate
            return peaks.get(dtype)
    return None


def compute_dtype(precision: str) -> str:
    """The tensor-core format a run's matmuls use: bf16, fp16, tf32 or fp32."""
    if precision.startswith("bf16") or precision == "float8":  # float8 MFU: of bf16 peak
        return "bf16"
    if precision == "16-mixed":
        return "fp16"
    # fp32 matmuls use TF32 units once the user allows it ("high" or "medium").
    return "fp32" if torch.get_float32_matmul_precision() == "highest" else "tf32"


def device_peak_flops(*, device: torch.device, precision: str,
                      override: float | None) -> float | None:
    """Peak FLOP/s per device: ``override`` if given (0 turns MFU off), else the table.

    None on CPU and on GPUs missing from the table: MFU is then reported as n/a.
    """
    if override is not None:
        return override or None
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return peak_flops_for(torch.cuda.get_device_name(device), compute_dtype(precision))


def _batch_size(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None


class FirstStepFlops:
    """Counts the FLOPs of the first training micro-step, then never again.

    ``start`` is called from the model's forward, ``stop`` after backward. The
    counter only observes the operators (a dispatch mode, stepped aside around compiled
    graphs, which are counted when compiled: :mod:`paratrain.flop_counter`), so the step
    computes exactly what it would without it, and a compiled step stays compiled.
    """

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.flops_per_sample: float | None = None
        self._counter: StepFlopCounter | None = None
        self._samples = 0

    @property
    def active(self) -> bool:
        return self._counter is not None

    def skip_user_compiled(self, model: Any) -> str | None:
        """Turn counting off for a model the script compiled itself; the notice to print.

        Its compiled code is not built by the run's counting backend, and the counter's
        dispatch mode around it would make Dynamo run it eagerly (older torch: for good).
        """
        if not self.enabled or not _compat.compiled_by_user(model):
            return None
        self.enabled = False
        return ("paratrain: the model was compiled before prepare, so MFU is n/a (counting "
                "its FLOPs would run it uncompiled); use Run(compile=True) instead of "
                "torch.compile to get both")

    def start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.enabled or self._counter is not None:
            return
        samples = _batch_size(args, kwargs)
        if not samples:
            self.enabled = False  # nothing to divide by: MFU stays n/a
            return
        self._samples = samples
        self._counter = StepFlopCounter()
        self._counter.start()

    def stop(self) -> None:
        if self._counter is None:
            return
        counter, self._counter = self._counter, None
        total = counter.stop()
        self.enabled = False
        self.flops_per_sample = total / self._samples if total else None


@dataclass
class Throughput:
    """Derived rates from the global samples/s: tokens/s, achieved TFLOP/s per device, MFU."""

    tokens_per_sample: int | None
    """Tokens in one sample, from ``Run(tokens_per_sample=...)``; None: no tokens/s."""
    peak_flops: float | None
    """Dense peak FLOP/s of one device; None: MFU is n/a."""
    flops_per_sample: float | None
    """Forward+backward FLOPs one device spends on one sample (its share of the model)."""
    replicas: int
    """Data-parallel replicas: the global samples/s split evenly among them."""
    on_gpu: bool = False
    """Whether MFU is worth showing as n/a in the bar (on CPU it is left out there)."""

    def rates(self, samples_per_s: float) -> dict[str, float | None]:
        """``tokens_per_s`` (when configured), ``tflops_per_device`` and ``mfu`` (None: n/a)."""
        out: dict[str, float | None] = {}
        if self.tokens_per_sample is not None:
            out["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        achieved = None
        if self.flops_per_sample is not None:
            achieved = self.flops_per_sample * samples_per_s / self.replicas
            out["tflops_per_device"] = achieved / T
        out["mfu"] = achieved / self.peak_flops if achieved is not None and self.peak_flops \
            else None
        return out

    def bar_rates(self, samples_per_s: float) -> dict[str, float | None]:
        """:meth:`rates` for the progress bar: no ``MFU n/a`` on CPU without a peak."""
        out = self.rates(samples_per_s)
        if out["mfu"] is None and self.peak_flops is None and not self.on_gpu:
            del out["mfu"]
        return out
