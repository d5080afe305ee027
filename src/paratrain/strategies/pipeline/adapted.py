"""Pipelines for models their adapter describes (Hugging Face models).

A model that is not ``nn.Sequential`` and has no ``pipeline_layout()`` method is split
by its model adapter (:mod:`paratrain.adapters`): the adapter names the parts
(:class:`~.layout.PipelineLayout`, dotted paths) and, when the model's ``forward``
cannot skip the parts another stage holds, gives a stage forward. The model is then
held by an :class:`AdaptedStage`, a module with the model's children under their own
names (so parameter names and checkpoints stay those of the full model) whose
``forward`` is the adapter's; the stages are cut from it as from any layout.

What travels between stages is one tensor per micro-batch. The first stage takes the
token ids only; :func:`prepare_inputs` checks the batch on every rank before the
schedule runs (a refusal raised by one stage alone would leave the others waiting).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paratrain.adapters import registered_adapters
from paratrain.strategies.pipeline.layout import PipelineLayout, check_layout, submodule_at


class AdaptedStage(nn.Module):
    """The model's children (and own parameters and buffers) under their names, run by
    the adapter's ``stage_forward(stage, input)``.

    Args:
        model: the full model; its children become this module's.
        stage_forward: the adapter's stage forward.
    """

    def __init__(self, model: nn.Module, stage_forward: Callable[..., Any]) -> None:
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, param in model._parameters.items():
            self.register_parameter(name, param)
        for name, buffer in model._buffers.items():
            self.register_buffer(name, buffer, persistent=name not in
                                 model._non_persistent_buffers_set)
        self.config = getattr(model, "config", None)
        self.model_class = type(model).__name__
        self._stage_forward = stage_forward

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self._stage_forward(self, inputs)


def adapted_layout(model: nn.Module) -> tuple[nn.Module, PipelineLayout]:
    """``model`` ready to cut (an :class:`AdaptedStage` where the adapter gives a stage
    forward) and its layout; ValueError in one line when no adapter describes it."""
    for adapter in registered_adapters():
        if adapter.pipeline_layout is None or not adapter.matches(model):
            continue
        layout = adapter.pipeline_layout(model)
        if layout is None:
            break  # the family's adapter, but not a structure it can split
        if not isinstance(layout, PipelineLayout):
            raise TypeError(f"adapter {adapter.name!r}: pipeline_layout must return a "
                            f"PipelineLayout, got {type(layout).__name__}")
        if adapter.stage_forward is not None:
            model = AdaptedStage(model, adapter.stage_forward)
        return model, check_layout(model, layout)
    raise ValueError(
        f"a pipeline cannot split {type(model).__name__}: it is not nn.Sequential, has no "
        "pipeline_layout() method and no model adapter describes its stages; give it a "
        "pipeline_layout() returning a PipelineLayout, or register an adapter with a "
        "pipeline_layout (paratrain.adapters.register_adapter; docs/strategies.md, 'Models')")


def stage_sharding(stage: nn.Module, blocks: str | None, options: Any) -> Any:
    """FSDP options for an adapted stage: by default its blocks are the units.

    FSDP gathers a unit's parameters when the unit is called. The default units are the
    root's children (``model``, ``lm_head``), but a stage forward calls ``model``'s parts
    and never ``model`` itself; the blocks are called, and the root holds the rest.
    ``blocks`` None (not an adapted stage) or a wrap policy given: ``options`` as is.
    """
    if blocks is None or options.wrap_policy is not None:
        return options
    units = {id(block) for block in submodule_at(stage, blocks)}
    return dataclasses.replace(options, wrap_policy=lambda module: id(module) in units)


def prepare_inputs(model_class: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The first stage's inputs: the token ids alone; ValueError for what cannot cross
    the stages (padding masks, extra inputs). Every rank calls it on the same batch."""
    kwargs = dict(kwargs)
    if "input_ids" in kwargs and not args:
        args = (kwargs.pop("input_ids"),)
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(torch.all(mask != 0)):
        raise ValueError(f"a pipelined {model_class} rebuilds its attention mask on each "
                         "stage and cannot carry padding; pass batches without padding "
                         "(no attention_mask), or train it with dp_shard or dp_replicate")
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
        extra = sorted(kwargs) or [f"{len(args)} positional arguments"]
        raise ValueError(f"a pipelined {model_class} takes the token ids (input_ids) only, "
                         f"got {', '.join(extra)}; compute the loss from its output (the "
                         "logits) instead of passing labels")
    return args, {}
