"""Pipelines of Hugging Face models, split by their model adapter (pipelines.py)."""

import pathlib
import sys
import tempfile

import pytest
import torch
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

pytest.importorskip("transformers")

import layout_cells  # noqa: E402
import model_layouts  # noqa: E402

import paratrain  # noqa: E402
from paratrain.adapters import ModelAdapter  # noqa: E402
from paratrain.strategies.pipeline.adapted import adapted_layout, prepare_inputs  # noqa: E402
from paratrain.strategies.pipeline.layout import split_model  # noqa: E402
from paratrain.testing.pool import spawn  # noqa: E402

TIES = {"llama_tied": ("model.embed_tokens.weight", "lm_head.weight"),
        "gpt2": ("transformer.wte.weight", "lm_head.weight"),
        "opt": ("model.decoder.embed_tokens.weight", "lm_head.weight")}
REFUSAL = ("a pipeline cannot split Net: it is not nn.Sequential, has no pipeline_layout() "
           "method and no model adapter describes its stages; give it a pipeline_layout() "
           "returning a PipelineLayout, or register an adapter with a pipeline_layout "
           "(paratrain.adapters.register_adapter; docs/strategies.md, 'Models')")


def stage(model_name, index):
    model, layout = adapted_layout(model_layouts.MODELS[model_name].build())
    return split_model(model, layout, num_stages=2, stage_indices=[index], split_points=None,
                       device=torch.device("cpu"), agree=None)


@pytest.mark.parametrize("model_name", ["llama", "llama_tied", "gpt2", "opt", "bert"])
def test_stages_run_one_after_the_other_compute_the_model(model_name):
    spec = model_layouts.MODELS[model_name]
    full = spec.build()
    inputs, _ = spec.batch()
    first, last = stage(model_name, 0), stage(model_name, 1)
    # The same calls in the same order as the model's forward: the same bits.
    assert torch.equal(last.whole(first.whole(inputs)), full(inputs).logits)
    # Every parameter under its full name, on exactly one stage (a tied one on both).
    names = [{n for n, _ in s.whole.named_parameters()} for s in (first, last)]
    assert names[0] | names[1] == {n for n, _ in full.named_parameters(remove_duplicate=False)}
    tie = TIES.get(model_name)
    assert names[0] & names[1] == set()
    assert first.ties == ((((tie[0], 0), (tie[1], 1)),) if tie else ())


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def forward(self, x):
        return self.layers[1](self.layers[0](x))


def test_a_model_no_adapter_knows_is_refused_naming_the_two_ways():
    with pytest.raises(ValueError) as refused:
        adapted_layout(Net())
    assert str(refused.value) == REFUSAL
    with pytest.raises(ValueError, match="a stage_forward needs a pipeline_layout"):
        ModelAdapter(name="x", matches=lambda m: True, stage_forward=lambda s, x: x)


def test_inputs_that_cannot_cross_the_stages_are_refused():
    ids = torch.ones(2, 3, dtype=torch.long)
    assert prepare_inputs("M", (), {"input_ids": ids, "attention_mask": torch.ones(2, 3)}) \
        == ((ids,), {})
    with pytest.raises(ValueError, match="^a pipelined M rebuilds its attention mask on each "
                                         "stage and cannot carry padding; pass batches"):
        prepare_inputs("M", (ids,), {"attention_mask": torch.tensor([[1, 1, 0], [1, 1, 1]])})
    # labels travel to the last stage, for the model's own loss.
    assert prepare_inputs("M", (), {"input_ids": ids, "labels": ids}) == ((ids,), {"labels": ids})
    with pytest.raises(ValueError, match="^a pipelined M takes the token ids \\(input_ids\\) "
                                         "and labels only, got position_ids; leave the other"):
        prepare_inputs("M", (ids,), {"position_ids": ids})


def refusal(model_name):
    run = paratrain.Run(strategy="pipeline", progress=False, accelerator="cpu")
    try:
        model = Net() if model_name is None else model_layouts.MODELS[model_name].build()
        model, _ = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        inputs, _ = model_layouts.MODELS[model_name].batch()
        model(inputs, attention_mask=(inputs > 3).long())  # padding: zeros in the mask
    except ValueError as exc:
        return str(exc)
    finally:
        run.close()
    return None


def refusal_worker(rank, world_size, model_names):
    # One Run after the other in the same processes: one spawn for both cases.
    return [refusal(name) for name in model_names]


@pytest.mark.slow
def test_every_rank_refuses_in_one_line_before_any_stage_runs():
    padding = ("a pipelined BertForSequenceClassification rebuilds its attention mask on "
               "each stage and cannot carry padding; pass batches without padding (no "
               "attention_mask), or train it with dp_shard or dp_replicate")
    expected = [REFUSAL, padding]
    assert spawn(refusal_worker, 2, [None, "bert"], timeout=240) == [expected, expected]


@pytest.mark.slow
@pytest.mark.parametrize("model_name, layout", [
    ("llama", "pp_gpipe"), ("bert", "pp_1f1b"), ("gpt2", "pp_gpipe"), ("llama_tied", "pp_1f1b"),
    ("opt", "pp_1f1b"),
])
def test_hf_pipeline_matches_one_process(model_name, layout):
    reference = model_layouts.reference_worker(0, 1, model_name)  # one process: here
    with tempfile.TemporaryDirectory() as errors:
        results = spawn(model_layouts.cell_worker, 2, model_name, layout, errors, timeout=300)
    # Losses and every stage's parameters within what reordering float32 sums allows.
    assert layout_cells.compare(results, reference)["status"] == "ok"
    if model_name in TIES:
        # The embedding (stage 0) and the head (stage 1) are copies of one tensor: their
        # gradients were summed, so they stayed equal bit for bit.
        state = results[0]["state"]
        first, last = TIES[model_name]
        assert torch.equal(state[first], state[last])
