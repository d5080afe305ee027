"""The built-in adapters: Hugging Face encoders, decoders and GPT-2, torchvision's ViT and ResNet.

Models whose layer names the automatic plan already reads (``paratrain.models.GPT``,
Llama/Mistral/Qwen2-style ``q_proj``/``o_proj``/``gate_proj``/``down_proj``) need no
tensor plan; the Hugging Face ones have adapters for their pipeline stages
(:mod:`.pipelines`).
"""

from __future__ import annotations

from torch import nn

from paratrain.adapters import ModelAdapter
from paratrain.adapters.pipelines import (
    decoder_layout,
    decoder_stage,
    encoder_layout,
    encoder_stage,
    gpt2_layout,
    gpt2_stage,
    opt_layout,
    opt_stage,
)


def _has_module(model: nn.Module, class_names: set[str]) -> bool:
    return any(type(m).__name__ in class_names for m in model.modules())


def _bert_plan(model: nn.Module) -> dict[str, str]:
    # Every BERT-style layer's dense linears are all called "dense"; their role comes
    # from where they sit.
    plan = {}
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind.endswith("SelfAttention"):
            plan.update({f"{name}.{leaf}": "colwise" for leaf in ("query", "key", "value")})
        elif kind.endswith("SelfOutput"):
            plan[f"{name}.dense"] = "rowwise"
        elif kind.endswith("Intermediate"):
            plan[f"{name}.dense"] = "colwise"
        elif kind.endswith("Output") and hasattr(module, "dense") and f"{name}.dense" not in plan:
            plan[f"{name}.dense"] = "rowwise"
    return plan


HF_ENCODER = ModelAdapter(
    name="hf-encoder",
    matches=lambda m: _has_module(m, {"BertSelfAttention", "RobertaSelfAttention",
                                      "XLMRobertaSelfAttention", "ElectraSelfAttention"}),
    tensor_plan=_bert_plan,
    split_attributes=("num_attention_heads", "all_head_size"),
    pipeline_layout=encoder_layout,
    stage_forward=encoder_stage,
)

HF_DECODER = ModelAdapter(
    name="hf-decoder",
    # Llama, Mistral, Qwen2 and the like: the automatic tensor plan reads their names.
    matches=lambda m: type(m).__name__.endswith("ForCausalLM")
    and decoder_layout(m) is not None,
    pipeline_layout=decoder_layout,
    stage_forward=decoder_stage,
)

HF_OPT = ModelAdapter(
    name="hf-opt",
    # OPT's q/k/v_proj, out_proj, fc1 and fc2 are what the automatic tensor plan reads.
    matches=lambda m: _has_module(m, {"OPTDecoder"}) and opt_layout(m) is not None,
    pipeline_layout=opt_layout,
    stage_forward=opt_stage,
)

HF_GPT2 = ModelAdapter(
    name="hf-gpt2",
    matches=lambda m: _has_module(m, {"GPT2Attention"}),
    # The MLP's Conv1D pair is split; attention stays whole on every tensor rank: c_attn
    # packs q, k and v in one (in, 3 x hidden) weight, whose even split would hand a rank
    # all of q and half of k (a per-head split needs a layout checkpoints do not have).
    tensor_plan=lambda m: {"*.h.*.mlp.c_fc": "colwise", "*.h.*.mlp.c_proj": "rowwise"},
    pipeline_layout=gpt2_layout,
    stage_forward=gpt2_stage,
)

TORCHVISION_VIT = ModelAdapter(
    name="torchvision-vit",
    matches=lambda m: type(m).__name__ == "VisionTransformer"
    and _has_module(m, {"MultiheadAttention"}),
    tensor_refusal=("tensor parallel of torchvision's ViT is not available: "
                    "nn.MultiheadAttention packs q/k/v in one in_proj_weight; use dp_shard "
                    "(fsdp) or dp_replicate (ddp)"),
)

TORCHVISION_RESNET = ModelAdapter(
    name="torchvision-resnet",
    matches=lambda m: type(m).__name__ == "ResNet",
    tensor_refusal=("tensor parallel splits transformer linears and has no meaning for a "
                    "ResNet (convolutions); use dp_replicate (ddp, with sync_batchnorm=True) "
                    "or dp_shard (fsdp)"),
)

BUILTIN: tuple[ModelAdapter, ...] = (HF_ENCODER, HF_GPT2, HF_OPT, HF_DECODER, TORCHVISION_VIT,
                                     TORCHVISION_RESNET)
