"""Context parallel through a training step: what the runtime calls around a model.

One :class:`ContextParallel` per process, built on the context-parallel group:

1. :meth:`~ContextParallel.attach` the model once: from then on every forward of it gets
   the true positions of its slice (when the model takes ``position_ids``) and runs with
   ``scaled_dot_product_attention`` answered over the whole sequence
   (:class:`~.routing.ContextParallelAttention`);
2. per step: :meth:`~ContextParallel.slice_batch`, forward, ``loss *``
   :meth:`~ContextParallel.loss_factor`, backward, :meth:`~ContextParallel.end_step`;
   gradients are then averaged over the cp ranks as data parallel averages them.

A training forward keeps the attention mode *armed* until :meth:`end_step`: activation
checkpointing recomputes blocks during backward, and torch runs backward without the
forward's torch function modes, so the recompute would attend over the local slice alone.
Hooks on every submodule re-enter the armed mode around a submodule's forward that runs
without it (the recompute), so the recomputed attention is the forward's, exactly.

Example:
    >>> cp = ContextParallel(group)                                  # doctest: +SKIP
    >>> cp.attach(model)                                             # doctest: +SKIP
    >>> out = model(**cp.slice_batch(batch))                         # doctest: +SKIP
    >>> (out.loss * cp.loss_factor()).backward(); cp.end_step()      # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.overrides import _get_current_function_mode_stack

from paratrain.strategies.context import batch as batches
from paratrain.strategies.context.attention import METHODS
from paratrain.strategies.context.routing import ContextParallelAttention
from paratrain.strategies.context.sequence import SequenceOrder

_INPUT_NAMES = ("input_ids", "inputs_embeds", "x")


class _CountingAttention(ContextParallelAttention):
    """:class:`ContextParallelAttention` that counts the calls it answers: a forward that
    made none did not attend through SDPA, and its numbers would be one slice's alone."""

    calls = 0

    def _attend(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return super()._attend(*args, **kwargs)


def _input_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The forward's (batch, sequence, ...) input: the first positional tensor, else a
    Hugging Face style keyword input, else the first keyword tensor."""
    for value in args:
        if isinstance(value, torch.Tensor):
            return value
    for name in _INPUT_NAMES:
        if isinstance(kwargs.get(name), torch.Tensor):
            return kwargs[name]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def _slot(model: nn.Module, name: str) -> int | None:
    """Index of parameter ``name`` among the forward's positional parameters (-1: keyword
    only), None when the forward does not take it."""
    try:
        params = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for index, param in enumerate(params):
        if param.name == name:
            positional = (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD)
            return index if param.kind in positional else -1
    return None


def _with_default(slot: int, args: tuple, kwargs: dict, name: str,
                  make: Callable[[], torch.Tensor]) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with ``make()`` as argument ``name`` where none was given."""
    given = kwargs.get(name)
    if given is None and 0 <= slot < len(args):
        given = args[slot]
    if given is not None:
        return args, kwargs
    if 0 <= slot < len(args):  # passed positionally as None
        return args[:slot] + (make(),) + args[slot + 1:], kwargs
    return args, {**kwargs, name: make()}


def _is_hugging_face(model: nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # loaded if the model is one
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _check_window(model: nn.Module, length: int) -> None:
    """Refuse a sliding window shorter than the sequence: the cp methods attend fully."""
    config = getattr(model, "config", None)
    window = getattr(config, "sliding_window", None)
    if window is None or getattr(config, "use_sliding_window", True) is False:
        return
    if int(window) < length:
        raise ValueError(
            f"context parallel attends over the whole sequence, but the model's config has "
            f"sliding_window={window}, shorter than the sequence ({length} tokens); train "
            "with sequences no longer than the window or without cp")


def _check_loss(model: nn.Module, kwargs: dict) -> None:
    """Refuse ``shift_labels`` that the model's loss would not read: it would shift the
    already shifted ``labels`` again (see :mod:`.batch`)."""
    if "shift_labels" not in kwargs or not hasattr(type(model), "loss_function"):
        return
    loss = model.loss_function
    try:
        takes = "shift_labels" in inspect.signature(loss).parameters
    except (TypeError, ValueError):
        takes = False
    if not takes:
        raise ValueError(
            f"context parallel passes Hugging Face labels as shift_labels, but "
            f"{type(model).__name__}'s loss {getattr(loss, '__name__', loss)!r} does not take "
            "shift_labels; train a causal LM, compute the loss outside the model, or train "
            "without cp")


def _exit(mode: _CountingAttention) -> None:
    """Pop ``mode``, which must be the innermost torch function mode."""
    stack = _get_current_function_mode_stack()
    if not stack or stack[-1] is not mode:
        # Popping would take another mode off the stack: say so rather than corrupt it.
        raise RuntimeError("context parallel's attention mode is not the innermost torch "
                           "function mode; exit modes entered inside the model's forward")
    mode.__exit__(None, None, None)


class ContextParallel:
    """Runs a model's forwards with each sequence split over the context-parallel group.

    Args:
        group: the context-parallel process group (None: the default group); the degree
            and this process's rank are read from it.
        method: ``"ring"`` (default) or ``"all_to_all"`` (see :mod:`.attention`).
        load_balanced: head-tail order (causal attention, the default) or one contiguous
            chunk per rank.
    """

    def __init__(self, group: Any, *, method: str = "ring", load_balanced: bool = True) -> None:
        if method not in METHODS:
            raise ValueError(f"context parallel method must be one of {sorted(METHODS)}, "
                             f"got {method!r}")
        self.group, self.method, self.load_balanced = group, method, load_balanced
        self.cp = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self._last: batches.SlicedBatch | None = None
        self._mode: _CountingAttention | None = None
        self._handles: list[Any] = []
        self._reentered: list[tuple[nn.Module, _CountingAttention]] = []

    def order(self, length: int) -> SequenceOrder:
        """The cut of a whole sequence of ``length`` tokens over this group."""
        return SequenceOrder(self.cp, length, self.load_balanced)

    def slice_batch(self, batch: Any) -> Any:
        """This rank's part of ``batch`` (:func:`.batch.slice_batch`); its target counts
        are kept for :meth:`loss_factor`."""
        self._last = batches.slice_batch(batch, cp=self.cp, rank=self.rank,
                                         load_balanced=self.load_balanced)
        return self._last.batch

    def loss_factor(self) -> float:
        """What to multiply the last sliced batch's mean loss by.

        ``local_tokens * cp / whole_tokens``: the mean over this rank's targets, times the
        factor, averaged over the cp ranks (as gradient averaging does), is the mean over
        the whole sequence's targets, however unevenly ``-100`` entries fall. 1.0 when the
        batch has no target or no counted target. A rank whose slice holds no counted
        target has a NaN mean loss (0/0), which no factor mends: sum its loss instead.
        """
        last = self._last
        if last is None or last.whole_tokens is None or last.whole_tokens == 0:
            return 1.0
        return last.local_tokens * self.cp / last.whole_tokens

    def attach(self, model: nn.Module) -> ContextParallel:
        """Hook ``model`` (the root module) so each forward runs under context parallel.

        Before a forward: inject this rank's global ``position_ids`` when the forward
        takes them and got none (for a Hugging Face model also an all-ones
        ``attention_mask``); refuse a config sliding window shorter than the whole
        sequence; enter the attention mode. After it: exit the mode and refuse a forward
        that made no ``scaled_dot_product_attention`` call. A training forward (grad
        enabled, ``model.training``) leaves the mode armed for the recompute of
        activation checkpointing (module docstring) until :meth:`end_step`. Returns self.
        """
        if self._handles:
            raise ValueError("this ContextParallel is already attached to a model; "
                             "detach() it first")
        slots = {"position_ids": _slot(model, "position_ids")}
        if _is_hugging_face(model):
            # Without a mask, transformers reads the load-balanced positions' jump as packed
            # sequences and materialises a block mask (use_cache=False, as in training):
            # an all-ones mask keeps its causal SDPA path (slice_batch drops the batch's).
            slots["attention_mask"] = _slot(model, "attention_mask")

        def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            tensor = _input_tensor(args, kwargs)
            if tensor is None or tensor.ndim < 2:
                raise ValueError(f"context parallel: {type(module).__name__}'s forward got no "
                                 "(batch, sequence, ...) input tensor")
            order = self.order(tensor.shape[1] * self.cp)
            _check_window(module, order.length)
            _check_loss(module, kwargs)
            defaults = {
                "position_ids": lambda: order.positions(self.rank, device=tensor.device)[None]
                .expand(tensor.shape[0], -1),
                "attention_mask": lambda: torch.ones(tensor.shape[:2], dtype=torch.long,
                                                     device=tensor.device)}
            for name, slot in slots.items():
                if slot is not None:
                    args, kwargs = _with_default(slot, args, kwargs, name, defaults[name])
            if self._mode is None:
                self._mode = _CountingAttention(self.group, order, self.method)
            else:  # armed by a training forward whose end_step has not come yet
                self._mode.order = order
            self._mode.calls = 0
            self._mode.__enter__()
            return args, kwargs

        def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            # output is None when the forward raised (always_call): exit, disarm, no check.
            mode = self._mode
            if mode is None:
                return
            if output is not None or _get_current_function_mode_stack()[-1:] == [mode]:
                _exit(mode)  # (a pre-hook that raised never entered it)
            if output is None or not (torch.is_grad_enabled() and module.training):
                self._mode = None
            if output is not None and mode.calls == 0:
                self._mode = None
                raise ValueError(
                    f"{type(module).__name__}'s attention does not go through "
                    "torch.nn.functional.scaled_dot_product_attention (e.g. "
                    'attn_implementation="eager"), so context parallel cannot see it; load it '
                    'with attn_implementation="sdpa" or train without cp')

        def reenter(module: nn.Module, args: tuple) -> None:
            # Outside the root's forward with the mode armed: a backward recompute.
            if self._mode is not None and self._mode not in _get_current_function_mode_stack():
                self._mode.__enter__()
                self._reentered.append((module, self._mode))

        def reexit(module: nn.Module, args: tuple, output: Any) -> None:
            if self._reentered and self._reentered[-1][0] is module:
                _exit(self._reentered.pop()[1])

        self._handles = [
            model.register_forward_pre_hook(before, with_kwargs=True),
            model.register_forward_hook(after, with_kwargs=True, always_call=True),
        ]
        for child in model.modules():
            if child is not model:
                self._handles += [child.register_forward_pre_hook(reenter),
                                  child.register_forward_hook(reexit, always_call=True)]
        return self

    def end_step(self) -> None:
        """Disarm the attention mode a training forward left for backward (call it after
        backward: recomputes during backward need it)."""
        self._mode = None

    def detach(self) -> None:
        """Remove the model's hooks (and disarm the attention mode)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.end_step()
