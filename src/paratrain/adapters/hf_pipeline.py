"""Pipeline stages from transformers' own pipeline plans (``base_model_pp_plan``).

A transformers decoder family that ships a pipeline plan names its parts in order on
its config class (``GPTNeoXConfig.base_model_pp_plan``: ``embed_in``, ``emb_dropout``,
``layers``, ``final_layer_norm``) and its head on the model class (``_pp_plan``:
``lm_head``). :func:`plan_layout` turns those into a :class:`PipelineLayout`, so a family
nobody named here is split without code of its own; :func:`decoder_stage` runs what the
family's ``forward`` runs for the parts a stage holds:

* the parts before the blocks, in the plan's order (embedding, dropout);
* positions ``0 .. T-1``, the rotary embedding of the base model (every stage holds it:
  it has no parameters), and the attention masks the model's ``forward`` builds, with
  its own functions (``create_causal_mask``, ``create_sliding_window_causal_mask``), one
  per kind of layer: ``config.layer_types`` (Gemma2's alternating sliding layers, Qwen2),
  else all sliding when the ``forward`` builds a sliding mask and ``config.sliding_window``
  is set (Mistral, Phi-3), else causal;
* the blocks each with the mask of its kind, the parts after them, the head, and the
  logits post-processing a config declares (``final_logit_softcapping``).

A ``forward`` building a mask this module does not know, or a layer kind it does not
know, is refused in one line; anything else a ``forward`` does that the stages miss
(a logit scale, an embedding multiplier) is caught by the check the strategy runs before
cutting (:func:`paratrain.strategies.pipeline.outputs.check_stages`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from paratrain.strategies.pipeline.layout import PipelineLayout, submodule_at

_MASKS = {"full_attention": "create_causal_mask",
          "sliding_attention": "create_sliding_window_causal_mask"}


def _tensor(output: Any) -> torch.Tensor:
    # Layers of older transformers versions return a tuple (hidden states first).
    return output[0] if isinstance(output, tuple) else output


def _mask_functions(base: nn.Module) -> set[str]:
    """The ``create_*mask`` functions the base model's ``forward`` calls."""
    code = inspect.unwrap(type(base).forward).__code__
    return {name for name in code.co_names if name.startswith("create_") and
            name.endswith("mask")}


def layer_kinds(model_class: str, base: nn.Module) -> list[str]:
    """The mask kind of each block, as the base model's ``forward`` picks it; ValueError
    in one line for a mask or a kind the stages cannot rebuild."""
    config = base.config
    known = _mask_functions(base)
    unknown = sorted(known - set(_MASKS.values()))
    if unknown:
        raise ValueError(f"a pipeline cannot rebuild the attention masks of {model_class} "
                         f"on each stage: its forward calls {unknown[0]}; train it with "
                         "dp_shard, dp_replicate or tp")
    count = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    if types:
        strange = sorted(set(types) - set(_MASKS))
        if strange:
            raise ValueError(f"a pipeline cannot rebuild the attention masks of {model_class}"
                             f" on each stage: layer type {strange[0]!r} is not one of "
                             f"{sorted(_MASKS)}; train it with dp_shard, dp_replicate or tp")
        return list(types[:count])
    sliding = (_MASKS["sliding_attention"] in known
               and getattr(config, "sliding_window", None) is not None)
    return ["sliding_attention" if sliding else "full_attention"] * count


def plan_layout(model: nn.Module) -> PipelineLayout | None:
    """The layout transformers' pipeline plan describes; None when the model has none
    (no ``base_model_pp_plan`` on its config, or no ``_pp_plan`` head on its class)."""
    prefix = getattr(model, "base_model_prefix", None)
    base = getattr(model, prefix, None) if isinstance(prefix, str) and prefix else None
    plan = getattr(getattr(base, "config", None), "base_model_pp_plan", None)
    head = getattr(type(model), "_pp_plan", None)
    if not isinstance(base, nn.Module) or not plan or not head:
        return None
    names = list(plan)
    blocks = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    if len(blocks) != 1 or not all(isinstance(getattr(base, n, None), nn.Module)
                                   for n in names) \
            or not all(isinstance(submodule_at(model, n), nn.Module) for n in head):
        return None
    split = names.index(blocks[0])
    return PipelineLayout(before=tuple(f"{prefix}.{n}" for n in names[:split]),
                          blocks=f"{prefix}.{blocks[0]}",
                          after=(*(f"{prefix}.{n}" for n in names[split + 1:]), *head))


def _post_process(config: Any, logits: torch.Tensor) -> torch.Tensor:
    # Gemma2ForCausalLM.forward's softcapping, the same three operations in its order.
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        logits = logits / cap
        logits = torch.tanh(logits)
        logits = logits * cap
    return logits


def decoder_stage(stage: nn.Module, hidden: torch.Tensor, *,
                  layout: PipelineLayout, kinds: list[str]) -> torch.Tensor:
    """The family's ``*ForCausalLM.forward`` for the parts ``stage`` holds (no cache).

    ``layout``: the parts (:func:`plan_layout`); ``kinds``: each block's mask kind
    (:func:`layer_kinds`); ``hidden``: the token ids on the first stage, the previous
    stage's hidden states after it.
    """
    from transformers import masking_utils

    base = submodule_at(stage, layout.blocks.rsplit(".", 1)[0])
    for name in layout.before:
        part = submodule_at(stage, name)
        if part is not None:
            hidden = part(hidden)
    positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
    blocks = list(submodule_at(stage, layout.blocks).named_children())
    masks = {kind: getattr(masking_utils, _MASKS[kind])(
        config=base.config, inputs_embeds=hidden, attention_mask=None, cache=None,
        position_ids=positions) for kind in {kinds[int(name)] for name, _ in blocks}}
    rotary = getattr(base, "rotary_emb", None)
    extra = {} if rotary is None else {
        "position_embeddings": rotary(hidden, position_ids=positions)}
    for name, block in blocks:
        hidden = _tensor(block(hidden, attention_mask=masks[kinds[int(name)]],
                               position_ids=positions, **extra))
    parts = [submodule_at(stage, name) for name in layout.after]
    for part in parts:
        if part is not None:
            hidden = part(hidden)
    if any(part is not None for part in parts):
        hidden = _post_process(base.config, hidden)
    return hidden
