"""Context parallel through a training step: :func:`slice_batch` cuts batches (tuple,
namedtuple, dict, Hugging Face labels shifted before the cut, padding refused), and
:class:`ContextParallel` attached to a model (positions injected, attention routed, mode
kept open for activation checkpointing's recompute) gives, with ``loss * loss_factor()``
and gradients averaged over the cp ranks, one process's mean loss and gradients on the
whole sequence, also with ``-100`` targets spread unevenly over the ranks."""

from collections import namedtuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack

from paratrain.activation_checkpointing import apply_activation_checkpointing
from paratrain.strategies.context import ContextParallel, slice_batch
from paratrain.strategies.context.sequence import SequenceOrder
from paratrain.testing.numerics import REASSOCIATION, assert_gradients_within
from paratrain.testing.pool import spawn

LENGTH, VOCAB = 16, 64
Pair = namedtuple("Pair", "tokens extra targets")


def tokens_and_targets() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, VOCAB, (2, LENGTH + 1), generator=torch.Generator().manual_seed(1))
    targets = tokens[:, 1:].clone()
    targets[:, :5] = -100  # most of rank 0's head chunk ignored: ranks count unevenly
    targets[0, 10] = -100
    return tokens[:, :-1], targets


# ---- slice_batch: pure logic ----------------------------------------------------------

def test_tuple_and_namedtuple_are_cut_in_sequence_order_and_counted():
    tokens, targets = tokens_and_targets()
    order = SequenceOrder(2, LENGTH)
    scalar, embeds = torch.tensor(3.0), torch.randn(2, LENGTH, 3)
    counts = []
    for rank in range(2):
        part = slice_batch([tokens, targets], cp=2, rank=rank)
        assert isinstance(part.batch, list)
        assert torch.equal(part.batch[0], order.slice(tokens, rank))
        assert torch.equal(part.batch[1], order.slice(targets, rank))
        nested = slice_batch(Pair(tokens, (embeds, scalar), targets), cp=2, rank=rank).batch
        assert type(nested) is Pair and type(nested.extra) is tuple
        assert torch.equal(nested.extra[0], order.slice(embeds, rank))
        assert nested.extra[1] is scalar  # not sequence-shaped: passed unchanged
        counts.append(part.local_tokens)
        assert part.whole_tokens == int((targets != -100).sum()) == 21
    assert counts == [int((order.slice(targets, r) != -100).sum()) for r in range(2)]
    assert counts[0] != counts[1] and sum(counts) == 21


def test_labels_become_shift_labels_cut_after_the_shift():
    tokens, targets = tokens_and_targets()
    labels = torch.cat([torch.full((2, 1), -100), targets[:, :-1]], dim=1)
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": labels}
    shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
    order = SequenceOrder(4, LENGTH)
    locals_ = []
    for rank in range(4):
        part = slice_batch(batch, cp=4, rank=rank)
        assert set(part.batch) == {"input_ids", "labels", "shift_labels"}  # mask dropped
        assert torch.equal(part.batch["shift_labels"], order.slice(shifted, rank))
        assert torch.equal(part.batch["labels"], part.batch["shift_labels"])
        assert part.whole_tokens == int((shifted != -100).sum())
        locals_.append(part.local_tokens)
    assert sum(locals_) == part.whole_tokens and len(set(locals_)) > 1
    assert slice_batch({"input_ids": tokens}, cp=2, rank=0).local_tokens is None


def test_padding_and_uneven_lengths_are_refused_in_one_line():
    tokens, _ = tokens_and_targets()
    mask = torch.ones_like(tokens)
    mask[1, -3:] = 0
    with pytest.raises(ValueError, match="padding masks are not supported") as caught:
        slice_batch({"input_ids": tokens, "attention_mask": mask}, cp=2, rank=0)
    assert "\n" not in str(caught.value)
    with pytest.raises(ValueError, match="divisible by 2 x cp = 8, got 12") as caught:
        slice_batch((tokens[:, :12], tokens[:, :12]), cp=4, rank=0)
    assert "\n" not in str(caught.value)


# ---- ContextParallel on whole models, against one process -----------------------------

def build(family: str, checkpointed: bool = False, **config) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt":
        from paratrain.models import GPT, Block

        model, block = GPT(vocab_size=VOCAB, block_size=LENGTH, n_layer=2, n_head=4,
                           n_embd=32), Block
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=LENGTH, attn_implementation="sdpa",
                        use_cache=not checkpointed)  # as training with checkpointing sets it
        model, block = LlamaForCausalLM(LlamaConfig(**{**settings, **config})), LlamaDecoderLayer
    if checkpointed:
        apply_activation_checkpointing(model, block)
    return model.train()


def training_batch(family: str):
    tokens, targets = tokens_and_targets()
    if family == "gpt":
        return tokens, targets
    labels = torch.cat([torch.full((2, 1), -100), targets[:, :-1]], dim=1)  # HF: unshifted
    return {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "labels": labels}


def mean_loss(model, family, batch):
    if family == "gpt":
        tokens, targets = batch
        return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten(), ignore_index=-100)
    return model(**batch).loss


def one_process(family: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = build(family)
    loss = mean_loss(model, family, training_batch(family))
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters()}


def training_worker(rank, world_size, cases):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)))
    results = {}
    for family, checkpointed, method in cases:
        model = build(family, checkpointed)
        cp = ContextParallel(group, method=method).attach(model)
        loss = mean_loss(model, family, cp.slice_batch(training_batch(family)))
        assert not _get_current_function_mode_stack()  # exited, armed for the recompute
        (loss * cp.loss_factor()).backward()
        cp.end_step()
        total = (loss.detach() * cp.loss_factor()).clone()
        dist.all_reduce(total, group=group)
        grads = {}
        for name, param in model.named_parameters():
            dist.all_reduce(param.grad, group=group)
            grads[name] = param.grad / world_size  # averaged, as data parallel does
        results[(family, checkpointed, method)] = (float(total) / world_size, grads)
    return results


# (family, activation checkpointing, method): one spawn per degree keeps the file fast.
CASES = {2: [("gpt", False, "ring"), ("llama", False, "ring"), ("gpt", True, "all_to_all"),
             ("llama", True, "ring")],
         4: [("gpt", True, "ring")]}


@pytest.mark.parametrize("cp", sorted(CASES))
def test_training_step_under_context_parallel_matches_one_process(cp):
    per_rank = spawn(training_worker, cp, CASES[cp])
    for family, checkpointed, method in CASES[cp]:
        loss, grads = one_process(family)
        got_loss, got_grads = per_rank[0][(family, checkpointed, method)]
        name = f"{family}{'+checkpoint' if checkpointed else ''}/{method}"
        assert abs(got_loss - loss) <= REASSOCIATION * abs(loss), (name, got_loss, loss)
        assert_gradients_within({f"{name}.{k}": v for k, v in got_grads.items()},
                                {f"{name}.{k}": v for k, v in grads.items()})


def refusal_worker(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    tokens, targets = tokens_and_targets()
    messages = {}
    try:
        ContextParallel(dist.group.WORLD, method="ulysses")
    except ValueError as exc:
        messages["method"] = str(exc)
    gpt = build("gpt")
    cp = ContextParallel(dist.group.WORLD).attach(gpt)
    with torch.no_grad():  # an evaluation forward closes the mode at once
        gpt(cp.slice_batch((tokens, targets))[0])
    messages["eval_stack"] = len(_get_current_function_mode_stack())
    cp.detach()
    for name, model in (("eager", build("llama", attn_implementation="eager")),
                        ("window", _mistral())):
        cp = ContextParallel(dist.group.WORLD).attach(model)
        try:
            model(**cp.slice_batch({"input_ids": tokens}))
        except ValueError as exc:
            messages[name] = str(exc)
        messages[f"{name}_stack"] = len(_get_current_function_mode_stack())
        cp.detach()
    return messages


def _mistral():
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
        attn_implementation="sdpa"))


def test_unsupported_models_are_refused_in_one_line():
    messages = spawn(refusal_worker, 2)[0]
    assert all("\n" not in m for m in messages.values() if isinstance(m, str))
    assert "'all_to_all', 'ring'" in messages["method"]
    assert 'attn_implementation="sdpa"' in messages["eager"]
    assert "sliding_window=8" in messages["window"] and "16 tokens" in messages["window"]
    assert messages["eval_stack"] == messages["eager_stack"] == messages["window_stack"] == 0
