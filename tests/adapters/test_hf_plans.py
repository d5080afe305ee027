"""Hugging Face families through transformers' own tensor plans, the automatic plan's
one-line refusals, sequence parallel with keyword inputs and FSDP units per block."""

import pathlib
import sys

import pytest
import torch
from torch import nn

from paratrain.adapters import _REGISTERED as registered
from paratrain.adapters import ModelAdapter, register_adapter
from paratrain.strategies.tensor.plan import (
    automatic_plan,
    check_divisible,
    resolve_plan,
    split_attributes,
)
from paratrain.testing.pool import spawn

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import model_layouts  # noqa: E402

SIZES = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
# Every head count divisible by 4 tensor ranks.
model_layouts.MODELS["llama_mha"] = model_layouts.ModelSpec(
    model_layouts._hf("LlamaConfig", "LlamaForCausalLM", num_key_value_heads=4,
                      attention_dropout=0.0), model_layouts._tokens, "transformers")
# No transformers plan: the automatic one, its kv-head count divided.
model_layouts.MODELS["stablelm"] = model_layouts.ModelSpec(
    model_layouts._hf("StableLmConfig", "StableLmForCausalLM", num_key_value_heads=2,
                      hidden_dropout=0.0, attention_dropout=0.0),
    model_layouts._tokens, "transformers")


def _distilbert():
    config = transformers.DistilBertConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4,
                                           hidden_dim=64, max_position_embeddings=16,
                                           num_labels=model_layouts.CLASSES, dropout=0.0,
                                           attention_dropout=0.0, seq_classif_dropout=0.0)
    torch.manual_seed(0)
    return transformers.DistilBertForSequenceClassification(config)


model_layouts.MODELS["distilbert"] = model_layouts.ModelSpec(
    _distilbert, model_layouts._sentences, "transformers")


def build(config_name, model_name, **fields):
    torch.manual_seed(0)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(
        **{**SIZES, **fields}))


def test_transformers_plans_come_first_prefixed_and_mapped_onto_torch_styles():
    neox = build("GPTNeoXConfig", "GPTNeoXForCausalLM", num_key_value_heads=None)
    plan = resolve_plan(neox, None)
    layer = "gpt_neox.layers.1"
    assert plan[f"{layer}.attention.query_key_value"] == plan[f"{layer}.mlp.dense_h_to_4h"] \
        == "colwise"
    assert plan[f"{layer}.attention.dense"] == plan[f"{layer}.mlp.dense_4h_to_h"] == "rowwise"
    assert plan["gpt_neox.embed_in"] == "embedding_rowwise"
    assert plan["lm_head"] == "colwise_gather_output" and len(plan) == 10
    # Only the config's plan: prefixed with the base model's attribute by paratrain.
    neox._tp_plan = {}
    assert resolve_plan(neox, None)["gpt_neox.layers.0.attention.dense"] == "rowwise"
    # An adapter the user registers is asked first: what is said explicitly wins.
    mistral = build("MistralConfig", "MistralForCausalLM")
    assert resolve_plan(mistral, None)["model.layers.0.self_attn.o_proj"] == "rowwise"
    adapter = ModelAdapter(name="mine", matches=lambda m: True,
                           tensor_plan=lambda m: {"lm_head": "colwise"})
    register_adapter(adapter)
    try:
        assert resolve_plan(mistral, None) == {"lm_head": "colwise"}
    finally:
        registered.remove(adapter)


def test_tied_modules_stay_whole_and_unsupported_styles_are_one_line():
    gemma = build("Gemma2Config", "Gemma2ForCausalLM", head_dim=8)  # tied by default
    plan = resolve_plan(gemma, None)
    assert "lm_head" not in plan and "model.embed_tokens" not in plan and len(plan) == 14
    mixtral = build("MixtralConfig", "MixtralForCausalLM", num_local_experts=2)
    with pytest.raises(ValueError, match=r"^transformers' tensor plan of MixtralForCausalLM gives "
                                         r"'model.layers.\*.mlp.experts.gate_up_proj' the style "
                                         "'packed_colwise', which paratrain does not run") as info:
        resolve_plan(mixtral, None)
    assert "\n" not in str(info.value)


def test_loss_parallel_refuses_to_untie_a_tied_output_layer():
    from paratrain.strategies.tensor.sequence import find_output_layer

    llama_tied = build("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"^loss_parallel would split lm_head.weight, which is "
                                         "tied to model.embed_tokens.weight; untie them"):
        find_output_layer(llama_tied, None)
    assert find_output_layer(build("LlamaConfig", "LlamaForCausalLM"), None) == "lm_head"


def test_automatic_plan_splits_a_block_completely_or_refuses_in_one_line():
    phi = build("PhiConfig", "PhiForCausalLM")
    with pytest.raises(ValueError, match=r"^the automatic tensor-parallel plan would split "
                                         r"'model.layers.0.self_attn' only in part \(colwise: "
                                         r"q_proj, k_proj, v_proj; rowwise: none; left whole: "
                                         r"dense\)"):
        automatic_plan(phi)  # as if Phi shipped no plan: its output 'dense' is no known name
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4))
    with pytest.raises(ValueError, match=r"^encoder.block.0.layer.0.SelfAttention."
                                         "relative_attention_bias holds one position bias per "
                                         "head"):
        resolve_plan(t5, None)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.head_dim, self.kv_heads = 8, 2  # a kv-head count under an unknown name
            self.q_proj, self.k_proj = nn.Linear(32, 32), nn.Linear(32, 16)
            self.v_proj, self.o_proj = nn.Linear(32, 16), nn.Linear(32, 32)

    with pytest.raises(ValueError, match=r"^0.kv_heads=2 counts heads that tensor parallel "
                                         r"splits, but paratrain does not know to divide it"):
        automatic_plan(nn.ModuleList([Attention()]))


def test_head_counts_are_divided_or_refused_in_one_line():
    stablelm = build("StableLmConfig", "StableLmForCausalLM")  # no shipped plan
    plan = resolve_plan(stablelm, None)
    assert plan["model.layers.0.self_attn.o_proj"] == "rowwise" and len(plan) == 14
    assert {"num_heads", "num_key_value_heads"} <= set(split_attributes(stablelm))
    gemma = build("GemmaConfig", "GemmaForCausalLM", num_key_value_heads=1, head_dim=8)
    with pytest.raises(ValueError, match=r"^model.layers.0.self_attn.config.num_key_value_heads"
                                         "=1 is not divisible by the tensor degree 2; choose a "
                                         "tensor degree that divides the number of heads$"):
        check_divisible(gemma, resolve_plan(gemma, None), 2)
    distilbert = transformers.DistilBertForSequenceClassification(transformers.DistilBertConfig(
        vocab_size=64, dim=32, n_layers=1, n_heads=4, hidden_dim=64))
    assert resolve_plan(distilbert, None) == {
        **{f"distilbert.transformer.layer.0.attention.{n}_lin": "colwise" for n in "qkv"},
        "distilbert.transformer.layer.0.attention.out_lin": "rowwise",
        "distilbert.transformer.layer.0.ffn.lin1": "colwise",
        "distilbert.transformer.layer.0.ffn.lin2": "rowwise"}


def test_fsdp_units_are_the_blocks_of_a_hugging_face_model():
    from paratrain.models import GPT
    from paratrain.strategies.dtensor_params import shared_outside
    from paratrain.strategies.fsdp import wrap_predicate

    def units(model):
        wrap, tied = wrap_predicate(None, model), shared_outside(model)
        return [n for n, m in model.named_modules() if n and wrap(m) and not tied(n, m)]

    assert units(build("MistralConfig", "MistralForCausalLM")) == [
        "model.embed_tokens", "model.layers.0", "model.layers.1", "lm_head"]
    llama_tied = build("LlamaConfig", "LlamaForCausalLM", tie_word_embeddings=True)
    assert units(llama_tied) == ["model.layers.0", "model.layers.1"]  # the tie in the root
    # Models without _no_split_modules keep their units (bitwise numerics).
    assert units(GPT(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16)) == [
        "tok_emb", "pos_emb", "blocks.0", "blocks.1", "ln_f", "head"]


CELLS_ON_TWO = [(name, "tp") for name in ("gpt_neox", "mistral", "phi", "gemma2", "stablelm",
                                          "distilbert")] + [
    ("llama", "tp_sp_lp"), ("llama", "fsdp"), ("llama_tied", "fsdp")]


def cells_worker(rank, world_size, cells):
    torch.set_num_threads(1)
    results = [model_layouts.train(name, model_layouts.LAYOUTS[layout][1])
               for name, layout in cells]
    return results, (fsdp_gathering() if world_size == 2 else None)


def fsdp_gathering():
    """Per-rank parameter bytes over one process's, and the largest share of the model's
    parameters gathered whole while a decoder layer runs forward."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    import paratrain

    run = paratrain.Run(strategy="fsdp", progress=False, accelerator="cpu", seed=3)
    model = build("LlamaConfig", "LlamaForCausalLM", num_hidden_layers=4)
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    model = run.prepare(model)
    local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    shares = []

    def gathered(module, args, kwargs):
        params = list(model.parameters())
        shares.append(sum(p.numel() for p in params if not isinstance(p, DTensor))
                      / sum(p.numel() for p in params))

    for layer in model.model.layers:
        layer.register_forward_pre_hook(gathered, with_kwargs=True)
    model(torch.randint(64, (2, 8)))
    units = [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]
    run.close()
    return {"memory": local / whole, "largest_gathered": max(shares), "units": units}


@pytest.mark.slow
def test_families_through_their_plans_and_sequence_parallel_match_one_process():
    outcomes = spawn(cells_worker, 2, CELLS_ON_TWO, timeout=600)
    references = {}
    for i, (name, layout) in enumerate(CELLS_ON_TWO):
        if name not in references:
            references[name] = model_layouts.reference_worker(0, 1, name)
        ranks = [results[i] for results, _ in outcomes]  # every rank's losses, rank 0's state
        cell = model_layouts.compare(ranks, references[name])
        assert cell["status"] == "ok", (name, layout, cell)
        assert ranks[0]["meshes"] == ([("shard",)] if layout == "fsdp" else [("tensor",)])
    fsdp = outcomes[0][1]
    # FSDP: each decoder layer its own unit, the forward gathers one at a time.
    assert [f"model.layers.{i}" for i in range(4)] == [
        u for u in fsdp["units"] if u.startswith("model.layers.")]
    assert fsdp["memory"] <= 0.55
    assert fsdp["largest_gathered"] < 0.35, fsdp


@pytest.mark.slow
def test_llama_with_sequence_and_loss_parallel_on_four_ranks_matches_one_process():
    reference = model_layouts.reference_worker(0, 1, "llama_mha")
    outcomes = spawn(cells_worker, 4, [("llama_mha", "tp_sp_lp")], timeout=600)
    cell = model_layouts.compare([results[0] for results, _ in outcomes], reference)
    assert cell["status"] == "ok", cell
