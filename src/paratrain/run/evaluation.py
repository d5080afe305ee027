"""What ``run.evaluate`` takes from each batch: the model's inputs and the labels.

A batch is ``(inputs, labels)`` (what a ``TensorDataset`` or most image datasets
yield), a dict that names both (Hugging Face style: ``{"input_ids": ..., "labels":
...}``), or anything a ``batch_fn`` turns into the pair. Anything else is one line
saying what was found and how to pass it, instead of ``too many values to unpack``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch

from paratrain.strategies.base import Strategy
from paratrain.strategies.capabilities import evaluation_batches

INPUT_KEYS = ("input", "inputs", "x", "input_ids", "image", "images", "pixel_values", "features")
LABEL_KEYS = ("label", "labels", "y", "target", "targets")
_FIX = "pass run.evaluate(..., batch_fn=lambda batch: (inputs, labels))"


def split_batch(batch: Any, batch_fn: Callable[[Any], Any] | None = None) -> tuple[Any, Any]:
    """``(inputs, labels)`` of ``batch``; ValueError in one line when it cannot tell them."""
    if batch_fn is not None:
        parts = batch_fn(batch)
        if not (isinstance(parts, (tuple, list)) and len(parts) == 2):
            raise ValueError(f"run.evaluate(batch_fn=...) must return (inputs, labels), "
                             f"got {describe(parts)}")
        return parts[0], parts[1]
    if isinstance(batch, Mapping):
        inputs = next((k for k in INPUT_KEYS if k in batch), None)
        labels = next((k for k in LABEL_KEYS if k in batch), None)
        if inputs is None or labels is None:
            missing = "input key" if inputs is None else "label key"
            raise ValueError(
                f"run.evaluate() got dict batches with keys {sorted(map(str, batch))} and "
                f"found no {missing} ({', '.join(INPUT_KEYS if inputs is None else LABEL_KEYS)}"
                f"); rename it, or {_FIX}")
        return batch[inputs], batch[labels]
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    raise ValueError(f"run.evaluate() needs batches of (inputs, labels) or dicts naming "
                     f"both, got {describe(batch)}; {_FIX}")


def describe(value: Any) -> str:
    """``a tuple of 3``, ``a Tensor of shape (8, 4)``, ``a str``: what a batch was."""
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def pairs(strategy: Strategy, loader: Iterable[Any],
          batch_fn: Callable[[Any], Any] | None) -> Iterator[tuple[tuple[Any, Any], bool]]:
    """``((inputs, labels), counted)`` for each of the strategy's evaluation batches
    (:func:`~paratrain.strategies.capabilities.evaluation_batches`)."""
    for batch, counted in evaluation_batches(strategy, loader):
        yield split_batch(batch, batch_fn), counted
