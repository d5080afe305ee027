"""Pipeline stages of the built-in adapters' models (Hugging Face decoders, GPT-2, BERT).

A Hugging Face ``forward`` computes positions, rotary embeddings and the attention mask
before its layers, so a stage cannot run it with the other stages' parts missing. Each
stage forward below does what that ``forward`` does for the parts the stage holds
(``None`` for the others), with the same calls in the same order, so a pipeline computes
what one process computes. Between stages only the hidden states travel: masks and
positions are rebuilt on each stage from their shape, which holds for unpadded batches
(``adapted.prepare_inputs`` refuses a padding mask before any stage runs).

The transformers imports are local: a model of that family was built, so it is installed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from paratrain.strategies.pipeline.layout import PipelineLayout


def _tensor(output: Any) -> torch.Tensor:
    # Layers of older transformers versions return a tuple (hidden states first).
    return output[0] if isinstance(output, tuple) else output


def _positions(hidden: torch.Tensor) -> torch.Tensor:
    return torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)


# -- decoder-only LMs: Llama, Mistral, Qwen2 (model.embed_tokens, layers, norm; lm_head) ----
def decoder_layout(model: nn.Module) -> PipelineLayout | None:
    """Embedding on the first stage, norm and head on the last."""
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")) \
            or not isinstance(getattr(model, "lm_head", None), nn.Module):
        return None
    return PipelineLayout(before=("model.embed_tokens",), blocks="model.layers",
                          after=("model.norm", "lm_head"))


_DECODER = PipelineLayout(before=("model.embed_tokens",), blocks="model.layers",
                          after=("model.norm", "lm_head"))


def decoder_stage(stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``LlamaForCausalLM.forward`` for the parts ``stage`` holds (no cache): the stage
    forward of transformers' pipeline plans (:mod:`.hf_pipeline`), for a decoder of this
    structure whose config ships no plan (its masks per layer kind, its softcapping)."""
    from paratrain.adapters.hf_pipeline import decoder_stage as plan_stage
    from paratrain.adapters.hf_pipeline import layer_kinds

    kinds = layer_kinds(getattr(stage, "model_class", type(stage).__name__), stage.model)
    return plan_stage(stage, hidden, layout=_DECODER, kinds=kinds)


# -- OPT (model.decoder.embed_tokens, embed_positions, layers, final_layer_norm; lm_head) ---
def opt_layout(model: nn.Module) -> PipelineLayout | None:
    """Token and learned position embeddings on the first stage, final norm and head on
    the last; OPT-350m's projections and post-norm layout are not described (refused)."""
    decoder = getattr(getattr(model, "model", None), "decoder", None)
    if decoder is None or not isinstance(getattr(model, "lm_head", None), nn.Module) or any(
            getattr(decoder, a, None) is not None for a in ("project_in", "project_out")) \
            or getattr(decoder, "final_layer_norm", None) is None:
        return None
    return PipelineLayout(before=("model.decoder.embed_tokens", "model.decoder.embed_positions"),
                          blocks="model.decoder.layers",
                          after=("model.decoder.final_layer_norm", "lm_head"))


def opt_stage(stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``OPTForCausalLM.forward`` for the parts ``stage`` holds (no cache, no padding)."""
    from transformers.masking_utils import create_causal_mask

    body = stage.model.decoder
    ones = torch.ones(hidden.shape[:2], device=hidden.device)
    # OPT numbers positions by counting the mask (``cumsum - 1``), as its forward does.
    positions = (torch.cumsum(ones, dim=1) * ones - 1).long()
    if body.embed_tokens is not None:
        hidden = body.embed_tokens(hidden)
        hidden = hidden + body.embed_positions(ones, 0, position_ids=positions).to(hidden.device)
    mask = create_causal_mask(config=body.config, inputs_embeds=hidden, attention_mask=None,
                              cache=None)
    for layer in body.layers:
        hidden = _tensor(layer(hidden, attention_mask=mask, position_ids=positions, cache=None,
                               use_cache=False))
    if body.final_layer_norm is not None:
        hidden = body.final_layer_norm(hidden)
    if stage.lm_head is not None:
        hidden = stage.lm_head(hidden).contiguous()
    return hidden


# -- GPT-2 (transformer.wte, wpe, drop, h, ln_f; lm_head tied to wte) ------------------------
def gpt2_layout(model: nn.Module) -> PipelineLayout | None:
    """Token and position embeddings on the first stage, final norm and head on the last."""
    if not isinstance(getattr(model, "lm_head", None), nn.Module) or not hasattr(
            getattr(model, "transformer", None), "h"):
        return None
    return PipelineLayout(before=("transformer.wte", "transformer.wpe", "transformer.drop"),
                          blocks="transformer.h", after=("transformer.ln_f", "lm_head"))


def gpt2_stage(stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``GPT2LMHeadModel.forward`` for the parts ``stage`` holds (no cache)."""
    from transformers.masking_utils import create_causal_mask

    body = stage.transformer
    positions = _positions(hidden)
    if body.wte is not None:
        hidden = body.wte(hidden)
        hidden = body.drop(hidden + body.wpe(positions).to(hidden.device))
    mask = create_causal_mask(config=body.config, inputs_embeds=hidden, attention_mask=None,
                              cache=None, position_ids=positions)
    for block in body.h:
        hidden = _tensor(block(hidden, None, mask, use_cache=False, position_ids=positions))
    if body.ln_f is not None:
        hidden = body.ln_f(hidden)
    if stage.lm_head is not None:
        hidden = stage.lm_head(hidden)
    return hidden


# -- BERT-style sequence classifiers ([base].embeddings, encoder.layer, pooler; classifier) --
def _encoder_base(model: nn.Module) -> tuple[str, nn.Module] | None:
    return next(((name, child) for name, child in model.named_children()
                 if hasattr(child, "embeddings") and hasattr(child, "encoder")), None)


def encoder_layout(model: nn.Module) -> PipelineLayout | None:
    """Embeddings on the first stage; pooler, dropout and classifier on the last."""
    found = _encoder_base(model)
    if found is None or getattr(found[1], "pooler", None) is None or not all(
            isinstance(getattr(model, a, None), nn.Module) for a in ("dropout", "classifier")):
        return None  # no pooled classification head: refused in one line by the strategy
    base = found[0]
    return PipelineLayout(before=(f"{base}.embeddings",), blocks=f"{base}.encoder.layer",
                          after=(f"{base}.pooler", "dropout", "classifier"))


def encoder_stage(stage: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """``BertForSequenceClassification.forward`` for the parts ``stage`` holds."""
    from transformers.masking_utils import create_bidirectional_mask

    _, base = _encoder_base(stage)
    if base.embeddings is not None:
        hidden = base.embeddings(input_ids=hidden)
    mask = create_bidirectional_mask(config=base.config, inputs_embeds=hidden,
                                     attention_mask=None)
    for layer in base.encoder.layer:
        hidden = _tensor(layer(hidden, mask))
    if stage.classifier is not None:
        hidden = stage.classifier(stage.dropout(base.pooler(hidden)))
    return hidden
