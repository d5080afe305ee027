"""Whole models under context parallel against one process: the paratrain GPT and a
Hugging Face Llama (SDPA attention), each rank holding a load-balanced slice of every
sequence (tokens, targets, positions). Summed over the cp ranks, the per-token loss sum
and every parameter's gradient equal one process's within float32's reassociation
bound; explicit masks and dropout are refused in one line."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.strategies.context.routing import ContextParallelAttention
from paratrain.strategies.context.sequence import SequenceOrder
from paratrain.testing.numerics import REASSOCIATION, assert_gradients_within
from paratrain.testing.pool import spawn

LENGTH, VOCAB = 16, 64


def build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        from paratrain.models import GPT

        return GPT(vocab_size=VOCAB, block_size=LENGTH, n_layer=2, n_head=4, n_embd=32)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=LENGTH, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2, LENGTH + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def logits_of(model, tokens, positions):
    out = model(tokens, position_ids=positions)
    return getattr(out, "logits", out)


def loss_sum(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")


def one_process(family: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = build(family)
    tokens, targets = batch()
    loss = loss_sum(logits_of(model, tokens, torch.arange(LENGTH)[None]), targets)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def context_worker(rank, world_size, method):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)))
    order = SequenceOrder(cp=world_size, length=LENGTH)
    results = {}
    for family in ("gpt", "llama"):
        model = build(family)
        tokens, targets = (order.slice(t, rank) for t in batch())
        with ContextParallelAttention(group, order, method):
            loss = loss_sum(logits_of(model, tokens, order.positions(rank)[None]), targets)
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        grads = {}
        for name, param in model.named_parameters():
            dist.all_reduce(param.grad, group=group)  # each rank saw part of the tokens
            grads[name] = param.grad
        results[family] = (float(total), grads)
    return results


@pytest.mark.parametrize("cp,method", [(2, "ring"), (4, "ring"), (2, "all_to_all")])
def test_models_under_context_parallel_match_one_process(cp, method):
    per_rank = spawn(context_worker, cp, method)
    for family in ("gpt", "llama"):
        loss, grads = one_process(family)
        got_loss, got_grads = per_rank[0][family]
        assert abs(got_loss - loss) <= REASSOCIATION * abs(loss), (family, got_loss, loss)
        assert_gradients_within({f"{family}.{k}": v for k, v in got_grads.items()},
                                {f"{family}.{k}": v for k, v in grads.items()})


def refusal_worker(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    order = SequenceOrder(cp=world_size, length=4)
    q = torch.zeros(1, 2, 2, 4)
    messages = []
    with ContextParallelAttention(dist.group.WORLD, order):
        for kwargs in ({"attn_mask": torch.ones(2, 2, dtype=torch.bool)}, {"dropout_p": 0.1}):
            try:
                F.scaled_dot_product_attention(q, q, q, **kwargs)
            except ValueError as exc:
                messages.append(str(exc))
    return messages


def test_masks_and_dropout_are_refused_in_one_line():
    messages = spawn(refusal_worker, 2)[0]
    assert len(messages) == 2 and all("\n" not in m for m in messages)
    assert "explicit attention mask" in messages[0]
    assert "dropout_p=0.1" in messages[1]
