"""A Hugging Face mixture of experts trained without its load-balancing loss gets one
notice at prepare (its configs default to output_router_logits=False); dense models and
MoE models with the loss on get none."""

import pytest
import torch

import paratrain
from paratrain.run.misuse import router_loss_notice

transformers = pytest.importorskip("transformers")


def mixtral(**fields):
    config = transformers.MixtralConfig(vocab_size=32, hidden_size=16, intermediate_size=16,
                                        num_hidden_layers=1, num_attention_heads=2,
                                        num_key_value_heads=1, num_local_experts=4, **fields)
    return transformers.MixtralForCausalLM(config)


def test_moe_without_router_loss_gets_one_notice_at_prepare(capsys):
    with paratrain.Run(strategy="single", progress=False, accelerator="cpu") as run:
        run.prepare(mixtral())
    printed = [line for line in capsys.readouterr().out.splitlines() if "experts" in line]
    assert len(printed) == 1
    assert "MixtralForCausalLM routes tokens to 4 experts" in printed[0]
    assert "set config.output_router_logits=True" in printed[0]


def test_no_notice_with_the_loss_on_or_for_dense_models():
    assert router_loss_notice(mixtral(output_router_logits=True)) is None
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1))
    assert router_loss_notice(llama) is None
    assert router_loss_notice(torch.nn.Linear(2, 2)) is None
