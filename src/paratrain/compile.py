"""``Run(compile=...)``: ``torch.compile`` options, CUDA-graph conditions and compile time.

The strategy applies the compiler itself (the
:class:`~paratrain.strategies.capabilities.Compiles` capability) because where it goes
depends on the wrapping: inside DDP (so that Dynamo's DDP optimiser splits the graph
at the gradient buckets), on each block before FSDP shards it, per pipeline stage.
Only the modules' ``forward`` is compiled: module hooks (FSDP's all-gathers, DDP's
bookkeeping) and the run's own forward wrapper stay outside the graph, and parameter
names (hence checkpoints) are those of the eager model.

Example:
    >>> CompileOptions.from_config({"mode": "reduce-overhead"}).cuda_graphs
    True
    >>> CompileOptions.from_config(False) is None
    True
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""``torch.compile`` modes that record CUDA graphs."""
_MODES = (None, "default", *CUDA_GRAPH_MODES, "max-autotune-no-cudagraphs")


@dataclass(frozen=True, kw_only=True)
class CompileOptions:
    """The ``torch.compile`` arguments of ``Run(compile={...})``."""

    mode: str | None = None
    """``default``, ``reduce-overhead`` (CUDA graphs), ``max-autotune`` (autotuning and
    CUDA graphs) or ``max-autotune-no-cudagraphs``."""

    fullgraph: bool = False
    """Fail on a graph break instead of running the rest eagerly."""

    dynamic: bool | None = None
    """Shapes: None recompiles with dynamic shapes when a second shape is seen."""

    backend: Any = "inductor"
    """A backend name (``inductor``, ``aot_eager``, ...) or a backend callable."""

    options: dict[str, Any] = field(default_factory=dict)
    """Backend options, e.g. ``{"triton.cudagraphs": True}`` (not with ``mode``)."""

    def __post_init__(self) -> None:
        if self.mode not in _MODES:
            raise ValueError(f"compile['mode'] must be one of {_MODES}, got {self.mode!r}")
        for name in ("fullgraph",):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"compile[{name!r}] must be True or False")
        if self.dynamic not in (None, True, False):
            raise ValueError(f"compile['dynamic'] must be None, True or False, "
                             f"got {self.dynamic!r}")
        if not (isinstance(self.backend, str) or callable(self.backend)):
            raise ValueError(f"compile['backend'] must be a backend name or callable, "
                             f"got {self.backend!r}")
        if not isinstance(self.options, dict):
            raise ValueError(f"compile['options'] must be a dict, got {self.options!r}")
        if self.mode not in (None, "default") and self.options:
            raise ValueError("compile: give either 'mode' or 'options', not both "
                             "(torch.compile accepts one of them)")

    @classmethod
    def from_config(cls, value: bool | dict[str, Any]) -> CompileOptions | None:
        """``RunConfig.compile`` as options: None for False, the defaults for True."""
        if value is False:
            return None
        if value is True:
            return cls()
        if not isinstance(value, dict):
            raise ValueError(f"compile must be True, False or a dict of torch.compile "
                             f"options, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"compile has unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**value)

    @property
    def cuda_graphs(self) -> bool:
        """Whether the compiled graphs are recorded as CUDA graphs."""
        return self.mode in CUDA_GRAPH_MODES or bool(self.options.get("triton.cudagraphs"))

    def without_cuda_graphs(self) -> CompileOptions:
        """The same compilation, without CUDA graphs."""
        mode = "max-autotune-no-cudagraphs" if self.mode == "max-autotune" else self.mode
        if mode == "reduce-overhead":
            mode = None
        options = {k: v for k, v in self.options.items() if k != "triton.cudagraphs"}
        return replace(self, mode=mode, options=options)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``torch.compile``."""
        out: dict[str, Any] = {"fullgraph": self.fullgraph, "dynamic": self.dynamic,
                               "backend": self.backend}
        if self.mode is not None:
            out["mode"] = self.mode
        if self.options:
            out["options"] = dict(self.options)
        return out


def cuda_graph_blockers(*, device: torch.device, precision: str, dynamic: bool | None,
                        strategy_reason: str | None) -> list[str]:
    """Why CUDA graphs cannot be used for this run (empty when they can).

    A CUDA graph replays fixed kernels on fixed addresses: it needs a CUDA device,
    the same shapes every step and no host reads of device values inside the step.
    """
    reasons = []
    if device.type != "cuda":
        reasons.append(f"they need a CUDA device (this run is on {device.type})")
    if dynamic:
        reasons.append("compile['dynamic'] is True (a graph is recorded per shape)")
    if precision == "16-mixed":
        reasons.append("precision '16-mixed' reads the loss scaler's inf check on the host "
                       "every step")
    if strategy_reason:
        reasons.append(strategy_reason)
    return reasons


def resolve(options: CompileOptions | None, *, device: torch.device, precision: str,
            strategy_reason: str | None) -> tuple[CompileOptions | None, str | None]:
    """The options to compile with and a one-line notice when CUDA graphs fall back."""
    if options is None or not options.cuda_graphs:
        return options, None
    reasons = cuda_graph_blockers(device=device, precision=precision, dynamic=options.dynamic,
                                  strategy_reason=strategy_reason)
    if not reasons:
        return options, None
    return options.without_cuda_graphs(), ("paratrain: compiling without CUDA graphs: "
                                           + "; ".join(reasons))


def partial_batch_notice(*, samples_per_rank: int, batch_size: int) -> str | None:
    """A one-line notice when CUDA graphs meet an epoch whose last batch is smaller."""
    rest = samples_per_rank % batch_size
    if not rest:
        return None
    return (f"paratrain: with CUDA graphs the last batch of each epoch ({rest} of {batch_size} "
            f"samples) is compiled and recorded as a second graph; a batch_size dividing "
            f"{samples_per_rank} keeps one static shape")


def compile_forward(module: nn.Module, options: CompileOptions) -> nn.Module:
    """Compile ``module.forward`` in place; returns ``module``.

    The bound ``forward`` is replaced rather than wrapping the module (as
    ``torch.compile(module)`` would), so state-dict keys keep their names and hooks
    registered on the module (FSDP's) run outside the compiled graph.
    """
    module.forward = torch.compile(module.forward, **options.kwargs())  # type: ignore[method-assign]
    return module


class CompileClock:
    """Times the first training micro-step (forward to end of backward), where
    ``torch.compile`` traces and compiles: reported as ``compile_s`` and left out of
    the epoch's samples/s."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled
        self.seconds: float | None = None
        self.stopped_at = 0.0
        self._start: float | None = None

    def start(self) -> None:
        if self.enabled and self._start is None:
            self._start = time.perf_counter()

    def stop(self) -> bool:
        """End the timed step; True the one time it ends."""
        if self._start is None or self.seconds is not None:
            return False
        self.stopped_at = time.perf_counter()
        self.seconds = self.stopped_at - self._start
        return True
