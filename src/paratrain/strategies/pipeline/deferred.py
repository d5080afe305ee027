"""Deferred outputs: how an unchanged training loop drives a pipeline schedule.

In a pipeline the forward and backward of all micro-batches are interleaved by
the schedule (GPipe, 1F1B), so ``model(x)`` cannot compute the output right
away. Instead it returns a :class:`Deferred` tensor that *records* what is done
with it: ``F.cross_entropy(out, y)`` becomes a node "cross_entropy of the output
and ``y``", ``loss / 2`` a node after it. ``run.backward(loss)`` then hands the
recorded chain to the schedule as the loss function of every micro-batch, and
afterwards each scalar node of the chain holds its value (the mean over the
micro-batches, or the sum for a ``reduction="sum"`` loss), so ``loss.item()``
and ``run.mean(loss)`` work as usual.

Every recorded operation is replayed on each micro-batch's output: reshapes
(``out.flatten(0, 1)``, ``out.view(-1, V)``, ``out[:, :-1]``) before the loss, the
loss ``fn(output, target, ...)``, then scalar arithmetic (scaling by constants).
A tensor argument is split into micro-batches with the input when its first
dimension is the batch, or, as a positional argument, ``m`` times the micro-batch
output's first dimension (a target flattened batch first, ``y.flatten()``). Other
uses of the output in training mode (e.g. ``out.argmax()``) cannot be evaluated
and raise when read. The output's shape is known when the strategy knows it (a
Hugging Face model's logits); otherwise asking for it raises one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from paratrain.distributed._compat import (
    make_tensor_subclass,
    torch_function_disabled,
    tree_map,
)

_SHAPE = {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.__len__,
          torch.Tensor.ndimension, torch.Tensor.nelement}
_READ_OUT = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__float__,
             torch.Tensor.__int__, torch.Tensor.__bool__, torch.Tensor.__format__,
             torch.Tensor.__repr__, torch.Tensor.__index__}


@dataclass
class Node:
    """One recorded operation; the root (``func is None``) is the model's output."""

    func: Callable[..., Any] | None
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    parent: Node | None = None
    value: torch.Tensor | None = None
    context: Any = None
    """For the root: whatever the strategy needs to run the schedule (inputs, module)."""

    @property
    def root(self) -> Node:
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    def chain(self) -> list[Node]:
        """Nodes from the first operation after the root down to this one."""
        nodes = []
        node: Node | None = self
        while node is not None and node.func is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    def call(self, parent_value: torch.Tensor,
             replace: Callable[[Any, bool], Any] = lambda a, positional: a) -> Any:
        """Apply this node's operation with the parent's value substituted;
        ``replace(arg, positional)`` maps the other arguments (a micro-batch's piece)."""
        args = tree_map(lambda a: parent_value if isinstance(a, Deferred) else replace(a, True),
                        self.args)
        kwargs = tree_map(lambda a: parent_value if isinstance(a, Deferred)
                          else replace(a, False), self.kwargs)
        return self.func(*args, **kwargs)


class Deferred(torch.Tensor):
    """A tensor whose value is known only after the pipeline schedule ran.

    Until then, torch operations on it are recorded (:class:`Node`); reading a
    number out of it (``item()``, ``float()``, printing) raises a clear error.
    Once resolved, it behaves like its value.
    """

    _node: Node
    _shape_known: bool

    @staticmethod
    def __new__(cls, node: Node, shape: tuple[int, ...] | None = None,
                device: torch.device | None = None) -> Deferred:
        # The placeholder answers metadata queries (dtype, device, and the shape when the
        # strategy knows it) during recording; expanded, it holds one number.
        data = torch.zeros((), device=device)
        tensor = make_tensor_subclass(cls, data if shape is None else data.expand(shape), False)
        tensor._node = node
        tensor._shape_known = shape is not None
        return tensor

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found: list[Deferred] = []
        tree_map(lambda a: found.append(a) if isinstance(a, Deferred) else None, (args, kwargs))
        nodes = {id(d._node): d._node for d in found}
        if all(node.value is not None for node in nodes.values()):
            resolved = tree_map(lambda a: a._node.value if isinstance(a, Deferred) else a,
                                (args, kwargs))
            return func(*resolved[0], **resolved[1])
        name = getattr(func, "__name__", repr(func))
        if name == "__get__":  # a property: its own name (shape, ndim, dtype)
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        asks_shape = func in _SHAPE or name in ("shape", "ndim")
        if asks_shape and not all(d._shape_known for d in found):
            raise ValueError(
                f"the shape of a pipeline's training output is known only after "
                f"run.backward(loss) (asked by {name}); write sizes taken from it as -1 "
                "(out.view(-1, n_classes)) or from the inputs")
        if getattr(func, "__name__", "") == "__get__" or func is torch.Tensor.is_floating_point \
                or asks_shape:
            # dtype, device, shape, requires_grad: answered by the placeholder.
            with torch_function_disabled():
                return func(*args, **kwargs)
        if func in _READ_OUT:
            raise RuntimeError(
                "this value comes out of the pipeline and is known only after "
                "run.backward(loss), and only for the loss; compute other uses of the "
                "output (e.g. out.argmax() for accuracy) under torch.no_grad() or with "
                "run.evaluate"
            )
        if len(nodes) != 1:
            raise RuntimeError(
                f"{getattr(func, '__name__', func)} combines two pipeline outputs; the loss "
                "must be a function of one model(x) output and targets"
            )
        (parent,) = nodes.values()
        return Deferred(Node(func, tuple(args), dict(kwargs), parent=parent))

    def __repr__(self) -> str:
        node = self._node
        if node.value is not None:
            return f"Deferred({node.value!r})"
        return "Deferred(<computed by the pipeline at run.backward>)"


def deferred_output(context: Any, shape: tuple[int, ...] | None = None,
                    device: torch.device | None = None) -> Deferred:
    """The placeholder a pipeline model returns in training mode (of ``shape`` when the
    strategy knows the output's shape)."""
    return Deferred(Node(None, context=context), shape, device)


def loss_chain(loss: Any) -> tuple[Node, list[Node]]:
    """The root and the chain of operations that made ``loss``; TypeError if not deferred."""
    if not isinstance(loss, Deferred):
        raise TypeError(
            "with strategy 'pipeline' the loss must be computed from the model's output, "
            "e.g. loss = F.cross_entropy(model(x), y); got a tensor that is not"
        )
    node = loss._node
    chain = node.chain()
    if not chain:
        raise TypeError("run.backward() got the model output itself; pass a loss computed from it")
    if node.value is not None:
        raise RuntimeError("run.backward() was already called on this loss")
    return node.root, chain
