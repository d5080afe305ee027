"""FLOPs of one training micro-step, also when parts of it are compiled.

``torch.utils.flop_counter.FlopCounterMode`` is a dispatch mode, and Dynamo does not
compile a frame entered while a non-infrastructure dispatch mode is on the stack: it
runs that call eagerly (torch 2.14) or, in older versions, marks the code to be skipped
for good. Holding the counter around a compiled step therefore defeats ``compile``. So
the counter is split in two:

* Eager code is counted live by the mode, as before.
* A compiled graph is counted once, when it is compiled: :func:`graph_flops` runs the
  graph and its backward on the compiler's fake tensors under a counter (no real
  computation, no random numbers). Each call of the graph during the counted step adds
  those FLOPs, with the mode stepped off the stack around the call
  (:meth:`StepFlopCounter.outside_mode`) so the compiled code runs. The graph's
  backward runs in autograd later, while the mode is on again: a pre-hook and a hook on
  its compiled backward node keep the mode from counting it a second time.

The result equals the eager count for the same step (a test compares them). A graph
whose FLOPs cannot be counted on fake tensors (dynamic shapes) makes the whole count
unknown: MFU is then reported as n/a rather than as a wrong number.

Example:
    >>> counter = StepFlopCounter()
    >>> counter.start()
    >>> _ = torch.ones(2, 3) @ torch.ones(3, 4)
    >>> counter.stop()
    48
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import torch
from torch.utils.flop_counter import FlopCounterMode

from paratrain.distributed import _compat

_COMPILED_NODE = "CompiledFunction"  # AOTAutograd's autograd node around a compiled graph


class StepFlopCounter:
    """Counts the FLOPs of one micro-step: live in eager code, per call in compiled graphs.

    At most one counter is active in a process (a dispatch mode is process-wide too);
    compiled graphs find it through :meth:`active`.
    """

    _active: ClassVar[StepFlopCounter | None] = None

    def __init__(self) -> None:
        self._mode: FlopCounterMode | None = None
        self._banked = 0  # finished live segments and compiled graphs' calls
        self._paused_at: int | None = None
        self._pauses = 0
        self.unknown = False
        """A compiled graph's FLOPs could not be counted: the total is not trustworthy."""

    @classmethod
    def active(cls) -> StepFlopCounter | None:
        """The counter of the micro-step being counted, if any."""
        return cls._active

    def start(self) -> None:
        self._mode = _compat.global_flop_counter()
        self._mode.__enter__()
        StepFlopCounter._active = self

    def stop(self) -> int | None:
        """End the count; the step's FLOPs, or None when part of it could not be counted."""
        mode, self._mode = self._mode, None
        StepFlopCounter._active = None
        if mode is not None:
            self._banked += mode.get_total_flops()
            mode.__exit__(None, None, None)
        return None if self.unknown else self._banked

    def add(self, flops: int | None) -> None:
        """FLOPs computed elsewhere (a compiled graph's call); None: unknown."""
        if flops is None:
            self.unknown = True
        else:
            self._banked += flops

    @contextlib.contextmanager
    def outside_mode(self) -> Iterator[None]:
        """Run a compiled call with the counting mode off the stack (see the module doc)."""
        mode = self._mode
        if mode is None:
            yield
            return
        self._banked += mode.get_total_flops()
        mode.__exit__(None, None, None)
        try:
            yield
        finally:
            mode.__enter__()  # starts from zero again: its earlier counts are banked

    def hook_compiled_backward(self, outputs: Any) -> bool:
        """Keep the live count out of the compiled backward of ``outputs``; True if found."""
        nodes = _compiled_nodes(outputs)
        for node in nodes:
            node.register_prehook(lambda grad_outputs: self._pause())
            node.register_hook(lambda grad_inputs, grad_outputs: self._resume())
        return bool(nodes)

    def _pause(self) -> None:
        if self._mode is not None and self._pauses == 0:
            self._paused_at = self._mode.get_total_flops()
        self._pauses += 1

    def _resume(self) -> None:
        self._pauses = max(0, self._pauses - 1)
        if self._pauses == 0 and self._mode is not None and self._paused_at is not None:
            # What the mode saw inside the compiled backward is in the graph's count.
            self._banked -= self._mode.get_total_flops() - self._paused_at
            self._paused_at = None


def _compiled_nodes(outputs: Any, depth: int = 3) -> list[Any]:
    """AOTAutograd's backward nodes behind ``outputs`` (through a few view nodes)."""
    tensors = [t for t in _compat.tree_leaves(outputs) if isinstance(t, torch.Tensor)]
    frontier = [t.grad_fn for t in tensors if t.grad_fn is not None]
    found: dict[int, Any] = {}
    seen: set[int] = set()
    for _ in range(depth):
        following = []
        for node in frontier:
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            if _COMPILED_NODE in node.name():
                found[id(node)] = node
            else:
                following.extend(next_node for next_node, _ in node.next_functions)
        frontier = following
    return list(found.values())


def graph_flops(graph: torch.fx.GraphModule,
                example_inputs: Sequence[Any]) -> tuple[int, int] | None:
    """Forward and backward FLOPs of one call of a Dynamo graph, on its fake inputs.

    None when they cannot be counted (no fake mode, symbolic sizes, an operator the
    fake tensors cannot run).
    """
    traced = [n.meta.get("example_value") for n in graph.graph.nodes if n.op == "placeholder"]
    if len(traced) != len(example_inputs):
        traced = [None] * len(example_inputs)
    # The mode of the fakes Dynamo traced with, else the compiler's (for real inputs).
    fake_mode = next((t.fake_mode for t in traced if hasattr(t, "fake_mode")), None) \
        or _compat.detect_fake_mode(example_inputs)
    if fake_mode is None:
        return None
    try:
        with fake_mode:
            inputs = [_fresh(fake_mode, t if t is not None else x)
                      for t, x in zip(traced, example_inputs)]
            with _compat.global_flop_counter() as forward:
                outputs = graph(*inputs)
            leaves = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
            results = [t for t in _compat.tree_leaves(outputs)
                       if isinstance(t, torch.Tensor) and t.requires_grad]
            with _compat.global_flop_counter() as backward:
                if leaves and results:
                    torch.autograd.grad(results, leaves,
                                        [torch.ones_like(t) for t in results],
                                        allow_unused=True)
    except Exception:  # a fake run that fails only loses the count, never the compile
        return None
    counts = (forward.get_total_flops(), backward.get_total_flops())
    if not all(isinstance(c, int) for c in counts):
        return None  # symbolic (dynamic shapes): not counted rather than specialised
    return counts


def _fresh(fake_mode: Any, value: Any) -> Any:
    # A fake copy (the sizes Dynamo traced with, symbolic ones too), so that the run's
    # in-place updates (running statistics) touch neither real tensors nor the fakes
    # the compiler goes on with.
    if not isinstance(value, torch.Tensor):
        return value
    if value.device.type != "meta" and not _compat.is_fake(value):
        value = fake_mode.from_tensor(value)
    return value.detach().clone().requires_grad_(value.requires_grad)
