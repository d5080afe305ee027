"""One context-parallel rank's part of a training batch.

:func:`slice_batch` cuts every sequence-shaped tensor of a batch (token ids, targets,
position ids, embeddings, a loss mask) in the :class:`~.sequence.SequenceOrder` of the
batch's sequence length, so a rank's targets stay beside its inputs. It also counts the
rank's targets (entries other than ``-100``), which :class:`~.apply.ContextParallel`
turns into the factor that keeps a mean loss with ignored entries exact.

Batch layouts understood:

* a tuple or list ``(inputs, ..., targets)``: the sequence length is dim 1 of the first
  element, the targets are the last element when it is an integer tensor;
* a mapping (a Hugging Face batch): the length is dim 1 of ``input_ids`` (else of the first
  tensor), the targets are ``shift_labels`` or ``labels``.

A Hugging Face causal LM shifts ``labels`` left by one inside its loss: on a slice that
would pair each chunk's last token with the next chunk's first label of *this* rank, not
the sequence's next token. So ``labels`` are shifted here, over the whole sequence, and
then cut: the result is passed as ``shift_labels`` (which transformers' ``ForCausalLMLoss``
uses as is) and, because the models compute a loss only when ``labels`` is not None, also
as ``labels`` (never shifted again: ``shift_labels`` wins in the loss).

An ``attention_mask`` of all ones says nothing and is dropped (the model then takes the
causal SDPA path that context parallel answers); a mask with padding is refused in one line.

Example:
    >>> tokens = torch.arange(16).reshape(2, 8)
    >>> part = slice_batch((tokens, tokens), cp=2, rank=1)
    >>> part.batch[0][0].tolist(), part.local_tokens, part.whole_tokens
    ([2, 3, 4, 5], 8, 16)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from paratrain.strategies.context.sequence import SequenceOrder

IGNORE_INDEX = -100
"""Target value that losses skip (torch's and transformers' default ``ignore_index``)."""


@dataclass(frozen=True)
class SlicedBatch:
    """One rank's part of a batch, with its target counts.

    Attributes:
        batch: the batch with every sequence-shaped tensor cut to this rank's positions.
        local_tokens: targets other than ``-100`` in this rank's part (None: no target).
        whole_tokens: targets other than ``-100`` in the whole sequence (None: no target).
    """

    batch: Any
    local_tokens: int | None
    whole_tokens: int | None


def _is_integer(value: Any) -> bool:
    return (isinstance(value, torch.Tensor) and value.dtype != torch.bool
            and not value.is_floating_point() and not value.is_complex())


def _first_tensor(batch: Any) -> torch.Tensor | None:
    """The tensor whose dim 1 is the sequence length (see the module docstring)."""
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, Mapping):
        if isinstance(batch.get("input_ids"), torch.Tensor):
            return batch["input_ids"]
        for value in batch.values():
            found = _first_tensor(value)
            if found is not None:
                return found
        return None
    if isinstance(batch, (tuple, list)) and batch:
        return _first_tensor(batch[0])
    return None


def _rebuild(original: Any, items: Any) -> Any:
    """A container of ``original``'s type holding ``items`` (a list, or a dict)."""
    if isinstance(original, Mapping):
        if type(original) is dict:
            return items
        try:  # OrderedDict, transformers' BatchEncoding, ...: keep the caller's type
            return type(original)(items)
        except TypeError:
            return items
    if isinstance(original, tuple) and hasattr(original, "_fields"):  # namedtuple
        return type(original)(*items)
    return type(original)(items)


def _check_mask(mask: Any) -> None:
    if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
        raise ValueError(
            "padding masks are not supported under context parallel (the batch's "
            "attention_mask has zeros); pack sequences without padding or train without cp")


def _shifted(labels: torch.Tensor) -> torch.Tensor:
    """``labels`` moved left by one along the sequence, ``-100`` after the last."""
    pad = torch.full_like(labels.narrow(1, 0, 1), IGNORE_INDEX)
    return torch.cat([labels.narrow(1, 1, labels.shape[1] - 1), pad], dim=1)


def _count(target: torch.Tensor) -> int:
    return int((target != IGNORE_INDEX).sum())


def slice_batch(batch: Any, *, cp: int, rank: int, load_balanced: bool = True) -> SlicedBatch:
    """Cut ``batch`` to context-parallel rank ``rank``'s positions of each sequence.

    Args:
        batch: a tensor, or a tuple/list/namedtuple/dict of them (nested containers keep
            their type).
        cp: context-parallel degree.
        rank: this rank's index in the context-parallel group.
        load_balanced: head-tail order (causal attention) or one contiguous chunk per rank.

    Returns:
        :class:`SlicedBatch`: the cut batch and the target counts.

    Raises:
        ValueError: (one line) a sequence length that ``2 cp`` (``cp`` unbalanced) does
            not divide, an attention mask with padding, or a batch without a tensor.
    """
    first = _first_tensor(batch)
    if first is None or first.ndim < 2:
        raise ValueError("context parallel needs a batch whose first tensor is "
                         "(batch, sequence, ...) shaped; got "
                         f"{type(batch).__name__} with first tensor "
                         f"{None if first is None else tuple(first.shape)}")
    length = first.shape[1]
    order = SequenceOrder(cp, length, load_balanced)

    def sequence_shaped(value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == length

    def cut(value: Any) -> Any:
        if sequence_shaped(value):
            return order.slice(value, rank)
        if isinstance(value, Mapping):
            if "attention_mask" in value:
                _check_mask(value["attention_mask"])
            return _rebuild(value, {key: cut(item) for key, item in value.items()
                                    if key != "attention_mask"})
        if isinstance(value, (tuple, list)):
            return _rebuild(value, [cut(item) for item in value])
        return value

    target = None
    if isinstance(batch, Mapping):
        labels, shift = batch.get("labels"), batch.get("shift_labels")
        if _is_integer(shift) and sequence_shaped(shift):
            target = shift
            if labels is not None:
                # Only the models' "labels is not None" gate reads it: keep it consistent.
                batch = _rebuild(batch, {**batch, "labels": shift})
        elif _is_integer(labels) and sequence_shaped(labels):
            # Shift over the whole sequence, before the cut: see the module docstring.
            target = _shifted(labels)
            batch = _rebuild(batch, {**batch, "labels": target, "shift_labels": target})
    elif isinstance(batch, (tuple, list)) and len(batch) >= 2:
        last = batch[-1]
        if _is_integer(last) and sequence_shaped(last):
            target = last

    sliced = cut(batch)
    if target is None:
        return SlicedBatch(sliced, None, None)
    return SlicedBatch(sliced, _count(order.slice(target, rank)), _count(target))
