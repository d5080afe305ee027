"""Pipelines of Hugging Face models: transformers' own pipeline plan, else an adapter.

A model that is not ``nn.Sequential`` and has no ``pipeline_layout()`` method is split,
in this order, by a model adapter the user registered, by the pipeline plan its
transformers family ships (``base_model_pp_plan`` and ``_pp_plan``,
:mod:`paratrain.adapters.hf_pipeline`), or by a built-in adapter
(:mod:`paratrain.adapters`: GPT-2, OPT, BERT-style encoders). Each names the parts
(:class:`~.layout.PipelineLayout`, dotted paths) and, when the model's ``forward``
cannot skip the parts another stage holds, gives a stage forward. The model is then
held by an :class:`AdaptedStage`, a module with the model's children under their own
names (so parameter names and checkpoints stay those of the full model) whose
``forward`` is the stage forward; the stages are cut from it as from any layout, once
:func:`~.outputs.check_stages` has seen them compute the model's logits.

What travels between stages is one tensor per micro-batch. The first stage takes the
token ids (and ``labels=``, for the model's own loss on the last stage);
:func:`prepare_inputs` checks the batch on every rank before the schedule runs (a
refusal raised by one stage alone would leave the others waiting).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from paratrain.adapters import ModelAdapter, registered_adapters
from paratrain.strategies.pipeline.layout import PipelineLayout, check_layout, submodule_at
from paratrain.strategies.pipeline.outputs import OutputSpec, check_stages


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
        self.outputs: OutputSpec | None = None
        """What the model returns (set once its stages are checked)."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self._stage_forward(self, inputs)


def _plan_adapter(model: nn.Module) -> ModelAdapter | None:
    """An adapter made of the transformers pipeline plan ``model``'s family ships."""
    from paratrain.adapters.hf_pipeline import decoder_stage, layer_kinds, plan_layout

    layout = plan_layout(model)
    if layout is None:
        return None
    kinds: list[str] = []

    def describe(model: nn.Module) -> PipelineLayout:
        base = submodule_at(model, layout.blocks.rsplit(".", 1)[0])
        kinds.extend(layer_kinds(type(model).__name__, base))  # or one line refusing it
        return layout

    return ModelAdapter(name="transformers-pp-plan", matches=lambda m: True,
                        pipeline_layout=describe,
                        stage_forward=partial(decoder_stage, layout=layout, kinds=kinds))


def _candidates(model: nn.Module) -> list[ModelAdapter]:
    from paratrain.adapters.builtin import BUILTIN

    builtin = {id(a) for a in BUILTIN}
    adapters = registered_adapters()
    plan = _plan_adapter(model)
    return [*(a for a in adapters if id(a) not in builtin), *([plan] if plan else []),
            *(a for a in adapters if id(a) in builtin)]


def adapted_layout(model: nn.Module) -> tuple[nn.Module, PipelineLayout]:
    """``model`` ready to cut (an :class:`AdaptedStage` where the adapter gives a stage
    forward, checked to compute the model's logits) and its layout; ValueError in one
    line when nothing describes it, or its stages would compute another function."""
    for adapter in _candidates(model):
        if adapter.pipeline_layout is None or not adapter.matches(model):
            continue
        layout = adapter.pipeline_layout(model)
        if layout is None:
            break  # the family's adapter, but not a structure it can split
        if not isinstance(layout, PipelineLayout):
            raise TypeError(f"adapter {adapter.name!r}: pipeline_layout must return a "
                            f"PipelineLayout, got {type(layout).__name__}")
        if adapter.stage_forward is not None:
            stages = AdaptedStage(model, adapter.stage_forward)
            if hasattr(model, "config") and hasattr(model, "loss_function"):
                stages.outputs = check_stages(model, stages)  # a transformers model
            model = stages
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
    """The first stage's inputs: the token ids (and ``labels``, kept for the loss);
    ValueError for what cannot cross the stages (padding masks, extra inputs). Every rank
    calls it on the same batch."""
    kwargs = dict(kwargs)
    labels = kwargs.pop("labels", None)
    if "input_ids" in kwargs and not args:
        args = (kwargs.pop("input_ids"),)
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(torch.all(mask != 0)):
        raise ValueError(f"a pipelined {model_class} rebuilds its attention mask on each "
                         "stage and cannot carry padding; pass batches without padding "
                         "(no attention_mask), or train it with dp_shard or dp_replicate")
    if len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
        extra = sorted(kwargs) or [f"{len(args)} positional arguments"]
        raise ValueError(f"a pipelined {model_class} takes the token ids (input_ids) and "
                         f"labels only, got {', '.join(extra)}; leave the other inputs out")
    return args, ({} if labels is None else {"labels": labels})
