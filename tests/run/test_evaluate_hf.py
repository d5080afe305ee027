"""``run.evaluate`` on Hugging Face models with padded dict batches equals a hand-written
loop over the model's own ``.loss``, on 1 and 2 ranks (sums and counts reduced exactly)."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.testing.pool import spawn

transformers = pytest.importorskip("transformers")

VOCAB, PAD, SAMPLES, LENGTH = 40, 0, 7, 6


def build(kind: str) -> torch.nn.Module:
    torch.manual_seed(1)
    if kind == "classifier":
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, intermediate_size=32,
                                         max_position_embeddings=16, num_labels=3,
                                         pad_token_id=PAD, initializer_range=0.5)
        return transformers.BertForSequenceClassification(config)
    if kind == "gpt2_lm":  # loss_type None: transformers' default loss, ForCausalLMLoss
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2,
                                         n_positions=16, pad_token_id=PAD, bos_token_id=1,
                                         eos_token_id=1, initializer_range=0.5)
        return transformers.GPT2LMHeadModel(config)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=2,
                                      num_key_value_heads=2, max_position_embeddings=16,
                                      pad_token_id=PAD, initializer_range=0.5)
    return transformers.LlamaForCausalLM(config)


def dataset(kind: str) -> list[dict]:
    """Sequences of different lengths, padded to LENGTH (left for the causal LM)."""
    g = torch.Generator().manual_seed(2)
    samples = []
    for i in range(SAMPLES):
        n = 2 + i % (LENGTH - 1)
        ids = torch.full((LENGTH,), PAD)
        mask = torch.zeros(LENGTH, dtype=torch.long)
        real = slice(0, n) if kind == "classifier" else slice(LENGTH - n, LENGTH)
        ids[real] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[real] = 1
        if kind == "classifier":
            labels = torch.randint(0, 3, (), generator=g)
        else:
            labels = torch.where(mask.bool(), ids, torch.full_like(ids, -100))
        samples.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return samples


@torch.no_grad()
def by_hand(model: torch.nn.Module, samples: list[dict], batch_size: int = 3) -> dict:
    """The loop a user writes: the model's mean ``.loss`` times the items it averaged."""
    model.eval()
    loss_sum, count = 0.0, 0
    for start in range(0, len(samples), batch_size):
        batch = torch.utils.data.default_collate(samples[start:start + batch_size])
        out = model(**batch)
        labels = batch["labels"]
        # A causal LM's loss predicts token t+1 from t: the first label is never scored.
        items = labels.numel() if labels.dim() == 1 else int((labels[:, 1:] != -100).sum())
        loss_sum += out.loss.double().item() * items
        count += items
    return {"loss": loss_sum / count, "count": count}


def evaluate(kind: str, mask: bool = True) -> dict:
    with paratrain.Run(accelerator="cpu", progress=False) as run:
        model = run.prepare(build(kind))
        samples = dataset(kind)
        if not mask:
            samples = [{k: v for k, v in s.items() if k != "attention_mask"} for s in samples]
        return run.evaluate(model, run.eval_loader(samples, batch_size=3))


def worker(rank: int, world_size: int) -> dict:
    return {kind: evaluate(kind) for kind in ("classifier", "causal_lm")}


@pytest.mark.parametrize("kind", ["classifier", "causal_lm", "gpt2_lm"])
def test_one_rank_equals_the_hand_written_loop(kind):
    expected = by_hand(build(kind), dataset(kind))
    result = evaluate(kind)
    assert result["count"] == expected["count"]
    assert result["loss"] == pytest.approx(expected["loss"], rel=1e-6)
    # The attention mask reached the model: without it the padded loss differs.
    assert abs(evaluate(kind, mask=False)["loss"] - expected["loss"]) > 1e-3


def test_two_ranks_equal_the_hand_written_loop():
    ranks = spawn(worker, 2, timeout=240)
    for kind in ("classifier", "causal_lm"):
        expected = by_hand(build(kind), dataset(kind))
        for result in ranks:
            assert result[kind]["count"] == expected["count"]
            assert result[kind]["loss"] == pytest.approx(expected["loss"], rel=1e-6)
