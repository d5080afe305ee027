"""Plain tensors out of DTensors, for code that must not care how a value is laid out."""

from __future__ import annotations

from typing import Any

__all__ = ["local_piece", "whole"]


def whole(value: Any) -> Any:
    """``value`` as a plain tensor: a DTensor (a sharded norm, vocabulary-sharded logits
    or a loss computed from them) is gathered whole; anything else is returned as is.

    Example:
        >>> import torch
        >>> whole(torch.ones(2)).tolist()
        [1.0, 1.0]
    """
    full_tensor = getattr(value, "full_tensor", None)
    return full_tensor() if full_tensor is not None else value


def local_piece(value: Any) -> Any:
    """A DTensor's local piece (a view that writes through), or ``value`` itself."""
    to_local = getattr(value, "to_local", None)
    return to_local() if to_local is not None else value
