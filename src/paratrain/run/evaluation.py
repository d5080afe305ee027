"""What ``run.evaluate`` takes from each batch and each model output.

Batches:

- ``(inputs, labels)`` (what a ``TensorDataset`` or most image datasets yield):
  ``model(inputs)``.
- a dict (Hugging Face style: ``{"input_ids", "attention_mask", "labels"}``): the labels
  are its label key (``labels``, ``label``, ``y``, ...). When the model's ``forward``
  takes every key as a keyword, every key goes in, ``model(**batch)`` (labels
  included); when it takes every key but the labels, ``model(**inputs)``; a dict
  with one input key and the labels (``{"image", "label"}``) calls ``model(image)``.
  Any other dict is one line: a key the model cannot take is never dropped silently.
- ``batch_fn(batch)``'s ``(inputs, labels)``; a dict of inputs is passed as keywords.

Outputs: a tensor of logits, or an object with ``.logits`` (Hugging Face
``ModelOutput``s). Token-level labels of a causal language model (``loss_type``
``ForCausalLM``, not encoder-decoder) are shifted by one as the model's own loss does;
labels of ``-100`` are ignored, as in Hugging Face.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from paratrain.strategies.base import Strategy
from paratrain.strategies.capabilities import evaluation_batches

INPUT_KEYS = ("input", "inputs", "x", "input_ids", "image", "images", "pixel_values", "features")
LABEL_KEYS = ("label", "labels", "y", "target", "targets")
IGNORE_INDEX = -100
_FIX = "pass run.evaluate(..., batch_fn=lambda batch: (inputs, labels))"


class ModelCall(NamedTuple):
    """One evaluation forward: ``model(*args, **kwargs)`` and the labels to score."""

    args: tuple
    kwargs: dict
    labels: Any


def split_batch(batch: Any, batch_fn: Callable[[Any], Any] | None = None,
                module: nn.Module | None = None) -> ModelCall:
    """How to call ``module`` on ``batch`` and its labels; one-line ValueError otherwise."""
    if batch_fn is not None:
        parts = batch_fn(batch)
        if not (isinstance(parts, (tuple, list)) and len(parts) == 2):
            raise ValueError(f"run.evaluate(batch_fn=...) must return (inputs, labels), "
                             f"got {describe(parts)}")
        if isinstance(parts[0], Mapping):
            return ModelCall((), dict(parts[0]), parts[1])
        return ModelCall((parts[0],), {}, parts[1])
    if isinstance(batch, Mapping):
        return _dict_call(batch, module)
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return ModelCall((batch[0],), {}, batch[1])
    raise ValueError(f"run.evaluate() needs batches of (inputs, labels) or dicts naming "
                     f"both, got {describe(batch)}; {_FIX}")


def _dict_call(batch: Mapping, module: nn.Module | None) -> ModelCall:
    keys = sorted(map(str, batch))
    label = next((k for k in LABEL_KEYS if k in batch), None)
    if label is None:
        raise ValueError(f"run.evaluate() got dict batches with keys {keys} and found no "
                         f"label key ({', '.join(LABEL_KEYS)}); rename it, or {_FIX}")
    inputs = {k: v for k, v in batch.items() if k != label}
    takes = _keywords(module)
    if takes is None or set(batch) <= takes:
        return ModelCall((), dict(batch), batch[label])
    if set(inputs) <= takes:
        return ModelCall((), inputs, batch[label])
    if len(inputs) == 1 and next(iter(inputs)) in INPUT_KEYS:
        return ModelCall((next(iter(inputs.values())),), {}, batch[label])
    if not any(k in INPUT_KEYS for k in inputs):
        raise ValueError(f"run.evaluate() got dict batches with keys {keys} and found no "
                         f"input key ({', '.join(INPUT_KEYS)}); rename it, or {_FIX}")
    unknown = sorted(str(k) for k in inputs if k not in takes)
    raise ValueError(f"run.evaluate() got dict batches with keys {keys} but the model's "
                     f"forward takes no argument named {', '.join(unknown)}; rename them to "
                     f"its arguments, or {_FIX}")


def _keywords(module: nn.Module | None) -> set[str] | None:
    """Names ``module.forward`` takes as keywords; None when it takes any (``**kwargs``)."""
    if module is None:
        return None
    try:
        # The class's forward: ``Run.prepare`` puts a (*args, **kwargs) forward on the instance.
        params = list(inspect.signature(type(module).forward).parameters.values())[1:]
    except (TypeError, ValueError, AttributeError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                 inspect.Parameter.KEYWORD_ONLY)}


def logits_of(output: Any) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, or ``output.logits``."""
    if isinstance(output, torch.Tensor):
        return output
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, Mapping):
        logits = output.get("logits")
    if not isinstance(logits, torch.Tensor):
        raise ValueError(f"run.evaluate() needs the model to return logits (a Tensor or an "
                         f"output with .logits), got {describe(output)}; pass "
                         "run.evaluate(..., loss_fn=lambda output, labels: summed_loss)")
    return logits


def align(module: nn.Module, logits: torch.Tensor, labels: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``(N, classes)`` and labels ``(N,)``; a causal LM's labels shifted by one."""
    if labels.dim() >= 1 and logits.dim() == labels.dim() + 1 and _causal_lm(module):
        labels = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)
    return logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)


def _causal_lm(module: nn.Module) -> bool:
    """A Hugging Face model whose own loss shifts token labels (``ForCausalLMLoss``)."""
    config = getattr(module, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return False
    if not hasattr(type(module), "loss_function"):
        return False
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    custom = getattr(module, "_loss_function", None)
    if custom is not None:
        return custom is ForCausalLMLoss
    # What the loss_function property picks, without its warning for loss_type None
    # (GPT2LMHeadModel): an unknown or missing loss_type means ForCausalLMLoss.
    loss_type = getattr(module, "loss_type", None)
    return LOSS_MAPPING.get(loss_type, ForCausalLMLoss) is ForCausalLMLoss


def describe(value: Any) -> str:
    """``a tuple of 3``, ``a Tensor of shape (8, 4)``, ``a str``: what a batch was."""
    if isinstance(value, torch.Tensor):
        return f"a Tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def calls(strategy: Strategy, module: nn.Module, loader: Iterable[Any],
          batch_fn: Callable[[Any], Any] | None) -> Iterator[tuple[ModelCall, bool]]:
    """``(call, counted)`` for each of the strategy's evaluation batches
    (:func:`~paratrain.strategies.capabilities.evaluation_batches`)."""
    for batch, counted in evaluation_batches(strategy, loader):
        yield split_batch(batch, batch_fn, module), counted
