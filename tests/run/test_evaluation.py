"""``run.evaluate`` reads (inputs, labels) pairs, dicts naming both, or ``batch_fn``'s pair."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paratrain
from paratrain.run.evaluation import split_batch


def batches():
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g))
            for _ in range(2)]


@pytest.fixture
def run_and_model():
    with paratrain.Run(accelerator="cpu", progress=False) as run:
        torch.manual_seed(0)
        yield run, run.prepare(nn.Linear(4, 3))


@pytest.mark.parametrize("as_dict", [
    lambda x, y: {"input": x, "label": y},
    lambda x, y: {"image": x, "label": y},
])
def test_dict_batches_evaluate_like_pairs(run_and_model, as_dict):
    run, model = run_and_model
    pairs = run.evaluate(model, batches())
    assert run.evaluate(model, [as_dict(x, y) for x, y in batches()]) == pairs
    assert pairs["count"] == 12


class Masked(nn.Module):
    """Takes ``input_ids`` and ``attention_mask`` by name, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 3)

    def forward(self, input_ids, attention_mask):
        return self.linear(input_ids * attention_mask)


def test_every_key_of_a_dict_batch_reaches_the_model():
    with paratrain.Run(accelerator="cpu", progress=False) as run:
        torch.manual_seed(0)
        model = run.prepare(Masked())
        masks = [torch.ones(6, 4), (torch.arange(4) < 2).float().expand(6, 4)]
        records = [{"input_ids": x, "attention_mask": m, "labels": y}
                   for (x, y), m in zip(batches(), masks)]
        by_hand = sum(nn.functional.cross_entropy(model(r["input_ids"], r["attention_mask"]),
                                                  r["labels"], reduction="sum").item()
                      for r in records) / 12
        assert run.evaluate(model, records)["loss"] == pytest.approx(by_hand, rel=1e-6)
        unmasked = [{**r, "attention_mask": torch.ones(6, 4)} for r in records]
        assert run.evaluate(model, unmasked)["loss"] != pytest.approx(by_hand, rel=1e-3)


def test_a_key_the_model_cannot_take_is_refused_not_dropped(run_and_model):
    run, model = run_and_model
    records = [{"input_ids": x, "attention_mask": torch.ones_like(x), "labels": y}
               for x, y in batches()]
    with pytest.raises(ValueError) as refused:
        run.evaluate(model, records)
    assert str(refused.value) == (
        "run.evaluate() got dict batches with keys ['attention_mask', 'input_ids', 'labels'] "
        "but the model's forward takes no argument named attention_mask, input_ids; rename "
        "them to its arguments, or pass run.evaluate(..., batch_fn=lambda batch: "
        "(inputs, labels))")


def test_batch_fn_picks_inputs_and_labels(run_and_model):
    run, model = run_and_model
    records = [{"features": {"pixels": x}, "class": y} for x, y in batches()]
    result = run.evaluate(model, records, batch_fn=lambda b: (b["features"]["pixels"], b["class"]))
    assert result == run.evaluate(model, batches())


@pytest.mark.parametrize("batch, expected", [
    ({"pixels": 1, "label": 2}, "run.evaluate() got dict batches with keys ['label', 'pixels'] "
                                "and found no input key (input, inputs, x, "),
    ({"input": 1, "class": 2}, "found no label key (label, labels, y, target, targets); "
                               "rename it, or pass run.evaluate(..., batch_fn="),
    ((1, 2, 3), "run.evaluate() needs batches of (inputs, labels) or dicts naming both, got a "
                "tuple of 3; pass run.evaluate(..., batch_fn=lambda batch: (inputs, labels))"),
    (torch.zeros(8, 4), "got a Tensor of shape (8, 4)"),
])
def test_a_batch_it_cannot_read_is_one_line(run_and_model, batch, expected):
    run, model = run_and_model
    with pytest.raises(ValueError) as refused:
        run.evaluate(model, [batch])
    assert expected in str(refused.value) and "\n" not in str(refused.value)


def test_batch_fn_must_return_a_pair():
    with pytest.raises(ValueError, match=r"batch_fn=\.\.\.\) must return \(inputs, labels\), "
                                         r"got a Tensor of shape \(2,\)"):
        split_batch({"x": 1}, lambda b: torch.zeros(2))
