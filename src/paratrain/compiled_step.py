"""The optimizer step compiled like the model: with CUDA graphs, the whole step is graphs.

``Run(compile={"mode": "reduce-overhead"})`` records the forward and backward as CUDA
graphs (inductor's CUDA-graph trees); the optimizer step would still launch its kernels
one by one, a few per parameter, which is most of a small model's step. A
:class:`CompiledOptimizerStep` runs ``optimizer.step()`` through ``torch.compile`` with
the model's backend and mode (PyTorch's "compiled optimizer" recipe), so that the update
is one graph too: ``compile['optimizer']``, on by default exactly when CUDA graphs are.

What it takes (each found on torch 2.14):

- **Tensor learning rates.** Dynamo specialises on a float ``lr``, so every scheduler
  change would recompile. Each group's ``lr`` becomes a float64 tensor on the
  parameters' device before the first step (and again after a checkpoint brings floats
  or CPU tensors back); torch's schedulers ``fill_`` tensor lrs in place, in float64
  the same values as with floats. ``scheduler.get_last_lr()`` then holds tensors.
- **capturable on CUDA.** Dynamo sets ``capturable=True`` on a fresh optimizer's groups
  (step counters on the device, no host reads); state loaded from an eager run's
  checkpoint has it False, so it is set here too (Dynamo moves the counters).
- **Dynamo's caches.** Dynamo caches compiled frames on code objects. Each compiled
  step calls a fresh copy of :func:`_step`, so its own frame's cache is its own; but
  ``Optimizer.step`` breaks the graph on purpose around its body (torch's ``_use_grad``),
  so the graph is compiled in torch's frames, shared by every optimizer of the process.
  Past ``torch._dynamo.config.recompile_limit`` (8) optimizers in one process (dead
  ones count too) Dynamo runs later steps eagerly, silently: that is detected after the
  first step (no graph was compiled) and said in one line.

Not bit for bit the eager step: traced, ``p.add_(g, alpha=-lr)`` with a tensor lr is one
fused multiply-add (one rounding instead of two) and Adam's bias corrections are taken
in float32 on the step tensor instead of Python floats, so parameters differ from the
eager run's by rounding (``tests/run/test_compiled_step.py`` bounds it). A step that
cannot be captured is stepped eagerly with float lrs, after one printed line:
:func:`strategy_blocker`, :func:`optimizer_blocker`, a failed first trace, no graph.

Example:
    >>> run = paratrain.Run(compile={"mode": "reduce-overhead"})  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from paratrain.compile import CompileOptions
from paratrain.distributed import _compat
from paratrain.strategies.base import Strategy

NOTICE = "paratrain: the optimizer step runs eagerly, not compiled: "
"""The start of every one-line fallback."""


def _step(optimizer: torch.optim.Optimizer) -> None:
    optimizer.step()


def strategy_blocker(strategy: Strategy) -> str | None:
    """Why ``strategy``'s optimizer step cannot be compiled as ``optimizer.step()``, or None.

    Only a step that is ``optimizer.step()`` and nothing else is replaced: one that
    communicates (a parameter server's push, sequence-parallel gradients completed
    across tensor peers) keeps its own code.
    """
    from paratrain.strategies.layout.strategy import LayoutStrategy

    own = type(strategy).optimizer_step
    if own is Strategy.optimizer_step:
        return None
    if own is LayoutStrategy.optimizer_step:
        tensor = strategy.layout.tensor  # type: ignore[attr-defined]
        if not (tensor and tensor.sequence_parallel):
            return None  # there it is optimizer.step() on the (DTensor) parameters
        return ("sequence parallel completes the gradients across tensor peers in its "
                "optimizer step (communication)")
    return (f"strategy {strategy.name!r} steps through its own code, not "
            "optimizer.step() (its step communicates: a parameter server's push, a "
            "semi-synchronous outer step)")


def optimizer_blocker(optimizer: torch.optim.Optimizer) -> str | None:
    """Why ``optimizer``'s step cannot be captured up front, or None."""
    name = type(optimizer).__name__
    if torch.distributed.is_available():
        from torch.distributed.optim import ZeroRedundancyOptimizer

        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return (f"zero1's {name} broadcasts each rank's updated shard inside its step "
                    "(Dynamo would cut the step at every collective)")
    closure = inspect.signature(optimizer.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        return f"{name}.step needs a closure (it evaluates the loss again), run.step gives none"
    if any(group.get("fused") for group in optimizer.param_groups):
        return (f"{name}(fused=True) runs torch's fused kernel, which Dynamo leaves eager "
                "(fused=False compiles the update)")
    return None


def use_tensor_lrs(optimizer: torch.optim.Optimizer) -> None:
    """Each group's ``lr`` as a float64 tensor on its parameters' device (kept if it is
    one); on CUDA, ``capturable`` set where the optimizer has it."""
    for group in optimizer.param_groups:
        device = group["params"][0].device if group["params"] else torch.device("cpu")
        lr = group["lr"]
        if not (isinstance(lr, torch.Tensor) and lr.device == device
                and lr.dtype == torch.float64):
            group["lr"] = torch.tensor(float(lr), dtype=torch.float64, device=device)
        if device.type == "cuda" and group.get("capturable") is False:
            group["capturable"] = True


def use_float_lrs(optimizer: torch.optim.Optimizer) -> None:
    """Each group's ``lr`` back to a Python float (exact: the tensors are float64)."""
    for group in optimizer.param_groups:
        if isinstance(group["lr"], torch.Tensor):
            group["lr"] = float(group["lr"])


class _Compiled:
    """One optimizer's compiled step (None once it fell back) and whether its first call
    was checked."""

    def __init__(self, step: Callable[[torch.optim.Optimizer], None] | None) -> None:
        self.step = step
        self.checked = False


class CompiledOptimizerStep:
    """Wraps a strategy's optimizer step: ``step(optimizer)`` runs it compiled.

    Built by :meth:`configure` (None when ``compile`` leaves the optimizer eager or the
    strategy's step cannot be compiled, said in one line). Each optimizer is compiled on
    its first step; one that cannot be is stepped by the strategy, after one line.

    Args:
        options: the run's resolved compile options (their backend, mode, dynamic).
        strategy: the run's; its ``optimizer_step`` is the eager fallback.
        print_fn: prints the one-line notices (rank 0's ``run.print``).
    """

    def __init__(self, options: CompileOptions, *, strategy: Strategy,
                 print_fn: Callable[[str], Any]) -> None:
        self._options = options
        self._strategy = strategy
        self._print = print_fn
        self._steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.graphs = 0
        """Graphs compiled for optimizer steps so far (recompiles included)."""

    @classmethod
    def configure(cls, options: CompileOptions | None, *, strategy: Strategy,
                  print_fn: Callable[[str], Any]) -> CompiledOptimizerStep | None:
        """The compiled step for a run compiled with ``options``, or None (eager)."""
        if options is None or not options.compiles_optimizer:
            return None
        reason = strategy_blocker(strategy)
        if reason:
            print_fn(NOTICE + reason)
            return None
        return cls(options, strategy=strategy, print_fn=print_fn)

    def __call__(self, optimizer: torch.optim.Optimizer) -> None:
        """One optimizer step of ``optimizer``: compiled, or the strategy's eager one."""
        compiled = self._steps.get(optimizer)
        if compiled is None:
            compiled = self._steps[optimizer] = self._compile(optimizer)
        if compiled.step is None:
            self._strategy.optimizer_step(optimizer)
            return
        use_tensor_lrs(optimizer)  # again after a checkpoint load brought floats back
        if compiled.checked:
            compiled.step(optimizer)
            return
        before = self.graphs
        try:
            compiled.step(optimizer)
        except RuntimeError as error:  # Dynamo's errors are RuntimeErrors
            if self.graphs != before:
                raise  # a graph was compiled and may have run: not ours to redo
            # Tracing failed before anything was updated: the eager step, once.
            text = str(error).strip()
            self._fall_back(optimizer, compiled,
                            f"Dynamo could not trace {type(optimizer).__name__}.step "
                            f"({type(error).__name__}: {text.splitlines()[0] if text else ''})")
            self._strategy.optimizer_step(optimizer)
            return
        compiled.checked = True
        if self.graphs == before:
            # Stepped, eagerly: Dynamo skipped the frames (recompile limit, skipped code).
            self._fall_back(optimizer, compiled,
                            f"Dynamo compiled no graph of {type(optimizer).__name__}.step "
                            "and ran it eagerly (a frame it skips, such as a host read in a "
                            "loop, or past torch._dynamo.config.recompile_limit optimizers in "
                            "one process: torch.compiler.reset() between runs)")

    def _compile(self, optimizer: torch.optim.Optimizer) -> _Compiled:
        reason = optimizer_blocker(optimizer)
        if reason:
            self._print(NOTICE + reason)
            return _Compiled(None)
        # A fresh copy of the code: Dynamo's cache of this frame is then this step's own.
        code = _step.__code__.replace()
        function = types.FunctionType(code, _step.__globals__, "compiled_optimizer_step")
        options = self._options
        compiler = _compat.compile_backend(options.backend, mode=options.mode,
                                           options=options.options or None,
                                           dynamic=options.dynamic)

        def backend(graph: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
            self.graphs += 1
            return compiler(graph, example_inputs)

        # Not fullgraph: Optimizer.step breaks the graph on purpose around its body.
        return _Compiled(torch.compile(function, backend=backend, dynamic=options.dynamic))

    def _fall_back(self, optimizer: torch.optim.Optimizer, compiled: _Compiled,
                   reason: str) -> None:
        use_float_lrs(optimizer)
        compiled.step = None
        self._print(NOTICE + reason)
