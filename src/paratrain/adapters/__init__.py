"""Model adapters: what is specific to a model family, in one registered place.

An adapter recognises a model by its structure and says what the parallelisms need
to know about it that names alone cannot tell: the tensor-parallel plan (which linear
is split colwise, which rowwise), the attributes that count heads or hold widths the
split divides, and, for layouts that have no meaning for the model, the one line that
refuses them; for a pipeline, its parts and how one stage runs. The first adapter
whose ``matches`` accepts the model is used; users register their own in front of the
built-in ones.

Example:
    >>> from paratrain.adapters import ModelAdapter, register_adapter
    >>> register_adapter(ModelAdapter(                              # doctest: +SKIP
    ...     name="my-net", matches=lambda m: type(m).__name__ == "MyNet",
    ...     tensor_plan=lambda m: {"blocks.*.attn.qkv_q": "colwise",
    ...                            "blocks.*.attn.out": "rowwise"}))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["ModelAdapter", "adapter_for", "register_adapter", "registered_adapters",
           "user_adapter_for"]


@dataclass(frozen=True, kw_only=True)
class ModelAdapter:
    """What a model family needs the parallelisms to know."""

    name: str
    """Shown in messages (e.g. ``"hf-bert"``)."""

    matches: Callable[[nn.Module], bool]
    """Whether ``model`` is of this family (by structure: class names, submodules)."""

    tensor_plan: Callable[[nn.Module], dict[str, str]] | None = None
    """``{module name or glob: "colwise" | "rowwise"}`` for tensor parallel; None: the
    automatic plan by layer names."""

    split_attributes: tuple[str, ...] = ()
    """Integer attributes of a split layer's parent (head counts, widths) that tensor
    parallel divides by its degree, besides ``n_head``/``num_heads``/``n_heads``."""

    tensor_refusal: str | None = None
    """One line saying why tensor parallel does not apply and what to use instead."""

    pipeline_layout: Callable[[nn.Module], Any] | None = None
    """``model -> PipelineLayout`` for a pipeline (parts named by dotted paths, e.g.
    ``"model.layers"``); None: the model needs its own ``pipeline_layout()`` method."""

    stage_forward: Callable[..., Any] | None = None
    """``(stage, input) -> output`` of one pipeline stage, for a model whose ``forward``
    cannot skip the parts another stage holds (Hugging Face models compute positions and
    masks before their layers). ``stage`` holds the model's children under their full
    names, the other stages' parts set to None; ``input`` is the token ids on the first
    stage and the previous stage's output after it; the last stage returns the logits."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"ModelAdapter.name must be a non-empty string, got {self.name!r}")
        if not callable(self.matches):
            raise ValueError("ModelAdapter.matches must be a function model -> bool")
        if self.tensor_plan is not None and self.tensor_refusal is not None:
            raise ValueError(f"adapter {self.name!r}: give a tensor_plan or a tensor_refusal, "
                             "not both")
        if self.stage_forward is not None and self.pipeline_layout is None:
            raise ValueError(f"adapter {self.name!r}: a stage_forward needs a pipeline_layout")


_REGISTERED: list[ModelAdapter] = []


def register_adapter(adapter: ModelAdapter) -> None:
    """Put ``adapter`` in front: it is asked before every adapter registered earlier."""
    if not isinstance(adapter, ModelAdapter):
        raise ValueError(f"register_adapter takes a ModelAdapter, got {type(adapter).__name__}")
    _REGISTERED.insert(0, adapter)


def registered_adapters() -> tuple[ModelAdapter, ...]:
    """The user's adapters (newest first), then the built-in ones."""
    from paratrain.adapters.builtin import BUILTIN

    return (*_REGISTERED, *BUILTIN)


def adapter_for(model: nn.Module) -> ModelAdapter | None:
    """The first adapter that recognises ``model``; None for a model no adapter knows."""
    return next((a for a in registered_adapters() if a.matches(model)), None)


def user_adapter_for(model: nn.Module) -> ModelAdapter | None:
    """The first adapter the user registered that recognises ``model``: it is asked
    before transformers' own plans, which come before the built-in adapters."""
    return next((a for a in _REGISTERED if a.matches(model)), None)
