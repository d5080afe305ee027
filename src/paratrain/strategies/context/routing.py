"""Routing a model's attention to context-parallel attention while it runs.

Models call ``torch.nn.functional.scaled_dot_product_attention`` (``paratrain.models``,
Hugging Face models with ``attn_implementation="sdpa"``). Inside
:class:`ContextParallelAttention` every such call is answered by the cp method over the
cp group (:mod:`.attention`), with the model's own arguments; nothing of the model is
patched, and outside the context the model is unchanged. Torch's own
``context_parallel()`` does the same through DTensor dispatch, but has no CPU sharding
rule; this is the plain-tensor form of it.

What cannot be computed across the cut is refused in one line, before any wrong number:
an explicit attention mask (padding, or a sliding window the model materialised),
attention dropout, a query length other than the key length (a KV cache).

Example:
    >>> with ContextParallelAttention(group, order):        # doctest: +SKIP
    ...     logits = model(tokens_slice, position_ids=order.positions(rank)[None])
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from paratrain.strategies.context.attention import METHODS
from paratrain.strategies.context.sequence import SequenceOrder


class ContextParallelAttention(TorchFunctionMode):
    """While active, ``scaled_dot_product_attention`` attends over the whole sequence.

    Args:
        group: the context-parallel process group.
        order: how the sequence is cut (the same order the batch was sliced with).
        method: ``"ring"`` (default) or ``"all_to_all"``.
    """

    def __init__(self, group: Any, order: SequenceOrder, method: str = "ring") -> None:
        super().__init__()
        if method not in METHODS:
            raise ValueError(f"context parallel method must be one of {sorted(METHODS)}, "
                             f"got {method!r}")
        self.group, self.order, self.method = group, order, METHODS[method]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        return self._attend(*args, **kwargs)

    def _attend(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, enable_gqa=False):
        if attn_mask is not None:
            raise ValueError(
                "context parallel computes the causal or bidirectional mask over the whole "
                "sequence itself, but the model passed an explicit attention mask (padding, "
                "or a sliding window): train without padding masks and with windows at least "
                "the sequence length, or without cp")
        if dropout_p:
            raise ValueError(f"context parallel attention has no dropout (the model asks for "
                             f"dropout_p={dropout_p}); set the model's attention dropout to 0 "
                             "or train without cp")
        if query.shape[-2] != key.shape[-2]:
            raise ValueError("context parallel needs as many queries as keys (no KV cache); "
                             "call the model without past key values")
        # enable_gqa: the cp methods repeat key/value heads themselves.
        return self.method(query, key, value, group=self.group, order=self.order,
                           causal=bool(is_causal), scale=scale)
