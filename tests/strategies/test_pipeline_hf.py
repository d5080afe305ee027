"""Hugging Face models under pipeline: transformers' pp plans, output objects, losses.

One process: every supported family's stages, chained without a schedule, give the
model's logits bit for bit (sliding windows shorter than the sequence, Gemma2's
alternating sliding layers and softcapping). Two gloo ranks (one spawn for all cases):
training returns the model's output object, ``labels=`` gives the model's own loss,
reshaped logits and flattened targets train as in one process, and a loss that cannot
be replayed per micro-batch is refused in one line on every rank.
"""

import pathlib
import sys
import types

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import layout_cells  # noqa: E402
import model_layouts  # noqa: E402

import paratrain  # noqa: E402
from paratrain.adapters.hf_pipeline import layer_kinds, plan_layout  # noqa: E402
from paratrain.strategies.pipeline.adapted import adapted_layout  # noqa: E402
from paratrain.strategies.pipeline.deferred import deferred_output  # noqa: E402
from paratrain.strategies.pipeline.layout import split_model  # noqa: E402
from paratrain.strategies.pipeline.module import check_chain  # noqa: E402
from paratrain.testing.numerics import REASSOCIATION, TrainingBound  # noqa: E402
from paratrain.testing.pool import spawn  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 64, 12, 4, 2
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4,
             max_position_embeddings=16)


def _config(name):
    t = transformers
    if name == "llama_tied":
        return t.LlamaConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=2,
                             tie_word_embeddings=True)
    if name == "mistral":  # every layer slides, window 4 < 12 tokens
        return t.MistralConfig(**SMALL, num_hidden_layers=2, num_key_value_heads=2,
                               head_dim=8, sliding_window=4)
    if name == "qwen2":  # layer 1 slides (layer_types), layer 0 attends to everything
        return t.Qwen2Config(**SMALL, num_hidden_layers=2, num_key_value_heads=2,
                             use_sliding_window=True, sliding_window=4, max_window_layers=1)
    if name == "gemma2":  # sliding, full, sliding, full; logits capped at 2
        return t.Gemma2Config(**SMALL, num_hidden_layers=4, num_key_value_heads=2,
                              head_dim=8, sliding_window=4, final_logit_softcapping=2.0,
                              attn_logit_softcapping=5.0, query_pre_attn_scalar=8)
    if name == "phi":
        return t.PhiConfig(**SMALL, num_hidden_layers=2, resid_pdrop=0.0, embd_pdrop=0.0,
                           partial_rotary_factor=0.5)
    if name == "gpt_neox":
        return t.GPTNeoXConfig(**SMALL, num_hidden_layers=2, hidden_dropout=0.0,
                               attention_dropout=0.0, rotary_pct=0.5)
    if name == "granite":  # multiplies its embeddings and divides its logits in forward
        return t.GraniteConfig(**SMALL, num_hidden_layers=2, embedding_multiplier=2.0,
                               logits_scaling=4.0)
    raise KeyError(name)


def build(name):
    if name in ("gpt2", "opt", "bert"):
        return model_layouts.MODELS[name].build()
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(_config(name))


PLANNED = ["llama_tied", "mistral", "qwen2", "gemma2", "phi", "gpt_neox"]
FAMILIES = [*PLANNED, "gpt2", "opt", "bert"]


def tokens(n=BATCH, seed=7):
    return torch.randint(VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", FAMILIES)
def test_stages_chained_in_one_process_compute_the_model(name):
    full = build(name)
    ids = tokens()
    expected = full(ids).logits
    model, layout = adapted_layout(build(name))
    stages = [split_model(adapted_layout(build(name))[0], layout, num_stages=2,
                          stage_indices=[i], split_points=None, device=torch.device("cpu"),
                          agree=None).whole for i in range(2)]
    assert torch.equal(stages[1](stages[0](ids)), expected)
    if name in PLANNED:  # split by transformers' own plan, no code of ours for it
        assert layout == plan_layout(build(name))
    assert model.outputs.output_class is type(full(ids))


def test_the_mask_kind_of_each_layer_is_the_models():
    assert layer_kinds("M", build("gemma2").model) == ["sliding_attention", "full_attention"] * 2
    assert layer_kinds("M", build("mistral").model) == ["sliding_attention"] * 2
    assert layer_kinds("M", build("qwen2").model) == ["full_attention", "sliding_attention"]
    assert layer_kinds("M", build("llama_tied").model) == ["full_attention"] * 2


def test_what_the_stages_cannot_reproduce_is_refused_in_one_line():
    with pytest.raises(ValueError) as refused:
        adapted_layout(build("granite"))
    assert str(refused.value) == (
        "a pipeline's stages of GraniteForCausalLM do not compute what its forward computes "
        "(their logits differ on a sample input), so it cannot be pipelined as it is; train "
        "it with dp_shard, dp_replicate or tp, or register an adapter whose stage_forward "
        "reproduces its forward (docs/strategies.md, 'Models')")

    class Chunked(torch.nn.Module):
        config = types.SimpleNamespace(num_hidden_layers=1, layer_types=None)

        def forward(self):
            return create_chunked_causal_mask()  # noqa: F821 (only its name is read)

    with pytest.raises(ValueError, match="^a pipeline cannot rebuild the attention masks of "
                                         "M on each stage: its forward calls "
                                         "create_chunked_causal_mask; train it with"):
        layer_kinds("M", Chunked())
    Chunked.config = types.SimpleNamespace(num_hidden_layers=1, layer_types=["chunked"])
    Chunked.forward = lambda self: None
    with pytest.raises(ValueError, match="layer type 'chunked' is not one of"):
        layer_kinds("M", Chunked())


def test_the_shape_of_an_output_of_unknown_shape_is_refused_in_one_line():
    out = deferred_output(None)
    with pytest.raises(ValueError, match="^the shape of a pipeline's training output is "
                                         "known only after run.backward\\(loss\\) \\(asked by shape\\); write sizes"):
        out.view(out.shape[0], -1)
    assert deferred_output(None, (4, 12, VOCAB)).size(-1) == VOCAB


def test_a_loss_whose_micro_batch_parts_do_not_add_up_is_refused_in_one_line():
    out, y = deferred_output(None, (4, 3)), torch.tensor([0, 1, 2, 0])
    check_chain(((F.cross_entropy(out, y, reduction="sum") / 4) * 2)._node.chain())
    check_chain((F.cross_entropy(out, y) + 1.0)._node.chain())  # a mean: each part 1/m
    with pytest.raises(ValueError, match="^a summed pipeline loss .* may only be scaled after "
                                         "it .*, got add: the micro-batches' parts"):
        check_chain((F.cross_entropy(out, y, reduction="sum") + 1.0)._node.chain())
    weight = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="^the pipeline loss passes a tensor that requires "
                                         "grad but does not come from the model's output to "
                                         "add;"):
        check_chain((F.cross_entropy(out, y) + weight.square().sum())._node.chain())


def test_the_models_own_loss_per_micro_batch_adds_up_to_its_mean_with_ignored_labels():
    model = build("llama_tied")
    spec = adapted_layout(model)[0].outputs
    ids = tokens()
    labels = ids.clone()
    labels[0, 3:] = -100  # micro-batches with different counts of labelled tokens
    logits = model(ids).logits
    out = spec.training_output(deferred_output(None, tuple(logits.shape)), labels)
    loss_fn = out.loss._node.func
    parts = [loss_fn(lg, lb) for lg, lb in zip(logits.split(2), labels.split(2))]
    want = model(ids, labels=labels).loss  # one process: the mean over labelled tokens
    assert loss_fn.sums_microbatches
    assert abs(float(sum(parts)) - float(want)) <= REASSOCIATION * float(want)
    # Not vacuous: the mean of the micro-batches' means is another number here.
    means = [spec.loss_function(lg, lb, VOCAB) for lg, lb in zip(logits.split(2), labels.split(2))]
    assert abs(float(sum(means)) / 2 - float(want)) > 4 * REASSOCIATION * float(want)


# -- two ranks ------------------------------------------------------------------------------
def _loss(form, model, x):
    if form == "labels":  # the model's own loss, model(**batch)
        return model(**{"input_ids": x, "labels": x, "attention_mask": torch.ones_like(x)}).loss
    out = model(input_ids=x)
    y = torch.roll(x, -1, dims=1)
    if form == "flatten":
        return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())
    if form == "view":
        return F.cross_entropy(out.logits.view(-1, VOCAB), y.view(-1))
    if form == "shift":  # out[0]: the first field, as a tuple
        logits = out[0]
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                               x[:, 1:].reshape(-1))
    if form == "whole_batch_view":  # the whole batch's size: not one micro-batch's
        return F.cross_entropy(out.logits.view(BATCH * SEQ, VOCAB), y.view(-1))
    raise KeyError(form)


def _evaluate(model, x):
    # eval(): a forward-only schedule; the output object on every stage.
    model.eval()
    with torch.no_grad():
        out = model(input_ids=x, labels=x)
    model.train()
    return type(out).__name__, out.logits.clone(), float(out.loss)


def train(name, form, options, reference=False):
    run = paratrain.Run(progress=False, accelerator="cpu", seed=3, **options)
    try:
        model = build(name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        bound = TrainingBound(model, optimizer) if reference else None
        aliases = {n: next(m for m, q in model.named_parameters() if q is p)
                   for n, p in model.named_parameters(remove_duplicate=False)}
        model, optimizer = run.prepare(model, optimizer)
        evaluated = _evaluate(model, tokens(seed=9)) if form == "labels" else None
        strategy, losses = run.strategy, []
        share = BATCH // strategy.data_parallel_size
        mine = slice(strategy.data_parallel_rank * share, (strategy.data_parallel_rank + 1) * share)
        for step in range(STEPS):
            loss = _loss(form, model, tokens(seed=step)[mine])
            run.backward(loss)
            run.step(optimizer)
            losses.append(float(run.mean(loss)))
        state = run.strategy.full_state_dict(model) if not reference else model.state_dict()
        result = {"losses": losses, "state": {k: v.detach().clone() for k, v in state.items()},
                  "evaluated": evaluated}
        if bound:
            result.update(tolerances=bound.tolerances(), buffer_tolerances={}, aliases=aliases)
        return result
    finally:
        run.close()


CASES = [("llama_tied", "flatten", "1f1b"), ("gpt2", "labels", "gpipe"),
         ("qwen2", "shift", "1f1b"), ("mistral", "labels", "1f1b"), ("gemma2", "view", "gpipe"),
         ("gpt_neox", "labels", "1f1b"), ("phi", "flatten", "1f1b")]
REPLAY = ("the pipeline replays view on each micro-batch (2 of 4 samples) and it failed: "
          "shape '[48, 64]' is invalid for input of size 1536; take sizes from the output as "
          "-1 (out.view(-1, V)) and give targets batch first, split like the input (y, "
          "y.flatten(), y[:, 1:])")


def pipeline_worker(rank, world_size, cases):
    torch.set_num_threads(1)
    results = []
    for name, form, schedule in cases:
        options = {"strategy": "pipeline",
                   "strategy_options": {"schedule": schedule, "num_microbatches": 2}}
        if schedule.startswith("pp="):  # a hybrid layout, by degrees
            options = {"parallel": schedule}
        try:
            results.append(train(name, form, options))
        except ValueError as exc:
            results.append(str(exc))
    return results


@pytest.mark.slow
def test_hf_models_train_under_pipeline_as_in_one_process():
    cases = [*CASES, ("llama_tied", "whole_batch_view", "1f1b")]
    results = spawn(pipeline_worker, 2, cases, timeout=600)
    for i, (name, form, _) in enumerate(CASES):
        check_against_one_process(name, form, [results[rank][i] for rank in range(2)])
    # Refused on every rank before any stage ran (both ranks return the one line).
    assert [results[rank][-1] for rank in range(2)] == [REPLAY, REPLAY]


def check_against_one_process(name, form, got):
    reference = train(name, form, {"strategy": "single"}, reference=True)
    assert layout_cells.compare(got, reference)["status"] == "ok", (name, form)
    if reference["evaluated"] is not None:
        kind, logits, loss = reference["evaluated"]
        for result in got:  # micro-batches reorder nothing within a sample's logits
            assert result["evaluated"][0] == kind
            torch.testing.assert_close(result["evaluated"][1], logits, rtol=REASSOCIATION,
                                       atol=REASSOCIATION * float(logits.abs().max()))
            assert abs(result["evaluated"][2] - loss) <= REASSOCIATION * loss


@pytest.mark.slow
def test_hf_model_output_under_hybrid_pipeline_x_fsdp():
    results = spawn(pipeline_worker, 4, [("llama_tied", "labels", "pp=2,dp_shard=2")],
                    timeout=600)
    check_against_one_process("llama_tied", "labels", [r[0] for r in results])


def load_worker(rank, world_size, directories):
    torch.set_num_threads(1)
    states = []
    for name, directory in directories:
        with paratrain.Run(strategy="pipeline", accelerator="cpu", progress=False) as run:
            model = run.prepare(build(name))
            run.load_pretrained(directory)
            state = run.strategy.full_state_dict(model)
            states.append({k: v.clone() for k, v in state.items()})
    return states


@pytest.mark.slow
def test_each_stage_loads_its_own_tensors_from_a_hugging_face_checkpoint(tmp_path):
    from paratrain.checkpoint import huggingface

    saved, directories = [], []
    for name in ("llama_tied", "gpt_neox"):
        model = build(name)
        with torch.no_grad():  # not the weights the workers build
            for param in model.parameters():
                param.add_(torch.rand_like(param))
        # One process's files: the tied head left out, as transformers writes it.
        huggingface.save_pretrained(tmp_path / name, model)
        saved.append(model.state_dict())
        directories.append((name, str(tmp_path / name)))
    results = spawn(load_worker, 2, directories, timeout=300)
    for states in results:
        for want, got in zip(saved, states):
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want)
