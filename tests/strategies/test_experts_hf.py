"""Hugging Face mixtures of experts under expert parallel, found by structure alone:
Mixtral, Qwen2-MoE (with its shared expert), Qwen3-MoE and OLMoE with their experts
split over 2 ranks that are also the data-parallel ranks, against one process on the
global batch (losses and every gradient within float32's reassociation bound)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from paratrain.strategies.experts.stacked import (
    DispatchedExperts,
    dispatch_stacked_experts,
    is_stacked_experts,
)
from paratrain.testing.numerics import REASSOCIATION, assert_gradients_within
from paratrain.testing.pool import spawn

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
LENGTH, VOCAB, EXPERTS = 8, 64, 4


def build(family: str) -> nn.Module:
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  num_experts_per_tok=2, attn_implementation="sdpa")
    configs = {
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": EXPERTS}),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                      {"num_experts": EXPERTS, "moe_intermediate_size": 16,
                       "shared_expert_intermediate_size": 32}),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      {"num_experts": EXPERTS, "moe_intermediate_size": 16, "head_dim": 8}),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": EXPERTS}),
    }
    config_name, model_name, extra = configs[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_name)(**common, **extra)
    return getattr(transformers, model_name)(config)


def global_batch(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2 * world, LENGTH + 1),
                           generator=torch.Generator().manual_seed(5))
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, tokens, targets):
    logits = model(input_ids=tokens).logits
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def hf_worker(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    results = {}
    for family in FAMILIES:
        model = build(family)
        assert dispatch_stacked_experts(model, dist.group.WORLD) == 2
        experts = {id(p) for m in model.modules() if isinstance(m, DispatchedExperts)
                   for p in m.parameters()}
        tokens, targets = (t.chunk(world_size)[rank] for t in global_batch(world_size))
        loss = loss_of(model, tokens, targets)
        loss.backward()
        grads = {}
        for name, param in model.named_parameters():
            if id(param) in experts:  # a sum over every rank's tokens: average it
                pieces = [torch.empty_like(param.grad) for _ in range(world_size)]
                dist.all_gather(pieces, param.grad / world_size)
                grads[name] = torch.cat(pieces)
            else:
                dist.all_reduce(param.grad)
                grads[name] = param.grad / world_size
        total = loss.detach().clone()
        dist.all_reduce(total)
        held = sum(p.numel() for p in model.parameters() if id(p) in experts)
        results[family] = (float(total) / world_size, grads, held)
    return results


def test_hf_moe_families_under_expert_parallel_match_one_process():
    per_rank = spawn(hf_worker, 2, timeout=300)
    for family in FAMILIES:
        model = build(family)
        stacked = sum(p.numel() for m in model.modules() if is_stacked_experts(m)
                      for p in (m.gate_up_proj, m.down_proj))
        loss = loss_of(model, *global_batch(2))
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        for got_loss, got_grads, held in (r[family] for r in per_rank):
            assert abs(got_loss - float(loss.detach())) <= REASSOCIATION * float(loss.detach())
            assert_gradients_within({f"{family}.{k}": v for k, v in got_grads.items()},
                                    {f"{family}.{k}": v for k, v in grads.items()})
            assert held * 2 == stacked  # each rank holds half the experts


def test_unsupported_expert_layout_is_one_line():
    model = build("mixtral")
    experts = next(m for m in model.modules() if is_stacked_experts(m))
    experts.has_bias = True

    class Group:
        pass

    from unittest import mock
    with mock.patch.object(dist, "get_world_size", return_value=2), \
            pytest.raises(ValueError, match=r"has has_bias=True: train this model"):
        dispatch_stacked_experts(model, Group())
