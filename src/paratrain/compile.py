"""``Run(compile=...)``: ``torch.compile`` options, CUDA-graph conditions and compile time.

The strategy applies the compiler itself (the
:class:`~paratrain.strategies.capabilities.Compiles` capability) because where it goes
depends on the wrapping: per repeated block or whole (``scope``) inside DDP, on each
block before FSDP shards it, per pipeline stage. The modules' ``forward`` is compiled
(and, with CUDA graphs or ``optimizer=True``, the optimizer step:
:mod:`paratrain.compiled_step`): module hooks (FSDP's all-gathers, DDP's bookkeeping)
and the run's own forward wrapper stay outside the graph, and parameter names (hence
checkpoints) are those of the eager model. Every graph goes through
:func:`counted_backend`, which counts its FLOPs for MFU without a dispatch mode around
the compiled call (:mod:`paratrain.flop_counter`).

Example:
    >>> CompileOptions.from_config({"mode": "reduce-overhead"}).cuda_graphs
    True
    >>> CompileOptions.from_config(False) is None
    True
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import nn

from paratrain.distributed import _compat
from paratrain.flop_counter import StepFlopCounter, graph_flops

CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
"""``torch.compile`` modes that record CUDA graphs."""
_MODES = (None, "default", *CUDA_GRAPH_MODES, "max-autotune-no-cudagraphs")
SCOPES = ("auto", "blocks", "model")
_SPARE_RECOMPILES = 8  # Dynamo's own default limit: shapes, a dynamic recompile
_COMPILED_PER_CODE: dict[Any, int] = {}  # modules compiled per forward code, this process


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

    scope: str = "auto"
    """What one graph covers: ``blocks`` compiles each repeated block (a transformer's
    layers) on its own, one graph shared by all of them, as torchtitan does: short
    compile times, the embedding and head stay eager; ``model`` compiles the whole
    forward; ``auto`` is ``blocks`` for a model with repeated blocks, else ``model``.
    Sharded layouts always compile per FSDP unit."""

    optimizer: bool | None = None
    """Compile the optimizer step too (:mod:`paratrain.compiled_step`), with the same
    backend and mode: with CUDA graphs the whole step is then graphs. None: exactly when
    CUDA graphs are on."""

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
        if not (self.optimizer is None or isinstance(self.optimizer, bool)):
            raise ValueError(f"compile['optimizer'] must be None, True or False, "
                             f"got {self.optimizer!r}")
        if self.scope not in SCOPES:
            raise ValueError(f"compile['scope'] must be one of {SCOPES}, got {self.scope!r}")
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

    @property
    def compiles_optimizer(self) -> bool:
        """Whether the optimizer step is compiled: ``optimizer``, else with CUDA graphs."""
        return self.cuda_graphs if self.optimizer is None else self.optimizer

    def without_cuda_graphs(self) -> CompileOptions:
        """The same compilation, without CUDA graphs (an explicit ``optimizer`` kept)."""
        mode = "max-autotune-no-cudagraphs" if self.mode == "max-autotune" else self.mode
        if mode == "reduce-overhead":
            mode = None
        options = {k: v for k, v in self.options.items() if k != "triton.cudagraphs"}
        return replace(self, mode=mode, options=options)

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``torch.compile``: the backend counts its graphs' FLOPs.

        One backend object per options object: Dynamo guards on the backend, so the
        blocks compiled with the same options share their graph.
        """
        backend = self.__dict__.get("_counted_backend")
        if backend is None:
            backend = counted_backend(_compat.compile_backend(
                self.backend, mode=self.mode, options=self.options or None,
                dynamic=self.dynamic))
            object.__setattr__(self, "_counted_backend", backend)  # a cache, not a field
        return {"fullgraph": self.fullgraph, "dynamic": self.dynamic, "backend": backend}


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


def counted_backend(compiler: Callable[..., Any]) -> Callable[..., Any]:
    """``compiler`` whose graphs add their FLOPs to the step being counted (for MFU).

    See :mod:`paratrain.flop_counter`: a graph is counted once on its fake inputs; each
    call during a counted micro-step adds that count. ``backend.compiled_at`` holds when
    each graph was compiled (``time.perf_counter()``): the recompiles of
    :meth:`CompileClock.report`.
    """
    def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        backend.compiled_at.append(time.perf_counter())  # type: ignore[attr-defined]
        counts = graph_flops(graph, example_inputs)
        compiled = compiler(graph, example_inputs)
        boxed = getattr(compiled, "_boxed_call", False)

        def run(*args: Any) -> Any:
            outputs = compiled(*args)
            counter = StepFlopCounter.active()
            if counter is not None:
                counter.add(None if counts is None else counts[0])
                # The backward is in the count only where it runs compiled; an eager
                # one (a backend without AOTAutograd) is counted live.
                if counts is not None and counter.hook_compiled_backward(outputs):
                    counter.add(counts[1])
            return outputs

        run._boxed_call = boxed  # type: ignore[attr-defined]
        return run

    backend.compiled_at = []  # type: ignore[attr-defined]
    return backend


def compile_forward(module: nn.Module, options: CompileOptions) -> nn.Module:
    """Compile ``module.forward`` in place; returns ``module``.

    The bound ``forward`` is replaced rather than wrapping the module (as
    ``torch.compile(module)`` would), so state-dict keys keep their names and hooks
    registered on the module (FSDP's) run outside the compiled graph. While the first
    step's FLOPs are counted, the compiled call runs with the counter's dispatch mode
    stepped aside: under it Dynamo would not compile.
    """
    code = getattr(type(module).forward, "__code__", type(module))
    _COMPILED_PER_CODE[code] = _COMPILED_PER_CODE.get(code, 0) + 1
    # Each module of a class may need its own graph of the shared code (a Hugging Face
    # layer guards on its own KV-cache slot): room for all of them and some shapes.
    _compat.allow_recompiles(_COMPILED_PER_CODE[code] + _SPARE_RECOMPILES)
    compiled = torch.compile(module.forward, **options.kwargs())

    def forward(*args: Any, **kwargs: Any) -> Any:
        counter = StepFlopCounter.active()
        if counter is None:
            return compiled(*args, **kwargs)
        with counter.outside_mode():
            return compiled(*args, **kwargs)

    module.forward = forward  # type: ignore[method-assign]
    return module


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: members of a ``ModuleList`` of two or more modules of
    one class with parameters (a transformer's layers), outermost lists only."""
    blocks: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside or not isinstance(module, nn.ModuleList):
            continue
        members = list(module)
        if (len(members) >= 2 and len({type(m) for m in members}) == 1
                and any(True for _ in members[0].parameters())):
            blocks.extend(members)
            inside.update(id(m) for block in members for m in block.modules())
    return blocks


def compile_model(model: nn.Module, options: CompileOptions) -> nn.Module:
    """Compile ``model`` in place at the options' scope (per block or whole); returns it."""
    blocks = repeated_blocks(model) if options.scope != "model" else []
    if options.scope == "blocks" and not blocks:
        raise ValueError(f"compile['scope'] is 'blocks' but {type(model).__name__} has no "
                         "repeated blocks (a ModuleList of layers of one class); use "
                         "scope 'auto' or 'model'")
    for block in blocks:
        compile_forward(block, options)
    return model if blocks else compile_forward(model, options)


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

    def report(self, options: CompileOptions | None) -> dict[str, float | int | None]:
        """``compile_s``, the ``graphs`` compiled so far and the ``recompiles`` among
        them (compiled after the first step: a new shape, a guard that failed)."""
        backend = None if options is None else options.__dict__.get("_counted_backend")
        times = getattr(backend, "compiled_at", [])
        later = [t for t in times if self.seconds is not None and t > self.stopped_at]
        return {"compile_s": self.seconds, "graphs": len(times), "recompiles": len(later)}
