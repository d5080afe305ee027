"""Router load over an epoch (paratrain.run.router_metrics): the per-layer tokens per expert
of paratrain's MoE GPT and of tiny Hugging Face mixtures of experts equal a count made by
hand from the router logits; evaluation forwards and activation checkpointing's recompute
are not counted; epoch_metrics resets; on 2 gloo ranks the counts are summed."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from paratrain.activation_checkpointing import apply_activation_checkpointing
from paratrain.models import GPT
from paratrain.run.router_metrics import RouterLoad
from paratrain.strategies.experts.moe import MoE
from paratrain.testing.pool import spawn

EXPERTS, TOP_K, LENGTH, VOCAB = 4, 2, 8, 64
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def gpt(experts: int = EXPERTS) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=LENGTH, n_layer=2, n_head=2, n_embd=16,
               experts=experts, top_k=TOP_K)


def hf(family: str):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                  num_experts_per_tok=TOP_K, output_router_logits=True)
    configs = {
        "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": EXPERTS}),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                      {"num_experts": EXPERTS, "moe_intermediate_size": 16,
                       "shared_expert_intermediate_size": 16}),
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      {"num_experts": EXPERTS, "moe_intermediate_size": 16, "head_dim": 8}),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", {"num_experts": EXPERTS}),
    }
    config_name, model_name, extra = configs[family]
    torch.manual_seed(0)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**common, **extra))


def batch(seed: int, rows: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, LENGTH), generator=torch.Generator().manual_seed(seed))


def by_hand(logits: torch.Tensor) -> torch.Tensor:
    """Tokens per expert of one layer's router logits: softmax, top-k, count."""
    chosen = F.softmax(logits.float(), dim=-1).topk(TOP_K, dim=-1).indices
    return torch.bincount(chosen.flatten(), minlength=EXPERTS)


def expected_metrics(counts: list[torch.Tensor]) -> dict[str, float]:
    stacked = torch.stack(counts).double()
    return {"router_max_over_mean_load": float((stacked.max(1).values / stacked.mean(1)).max()),
            "router_tokens_per_expert_min": float(stacked.min()),
            "router_tokens_per_expert_max": float(stacked.max())}


def gpt_router_logits(model: GPT) -> list[list[torch.Tensor]]:
    """Record every MoE router's logits, one list per layer (hooks on the Linear)."""
    seen: list[list[torch.Tensor]] = []
    for layer in (m for m in model.modules() if isinstance(m, MoE)):
        seen.append([])
        layer.router.register_forward_hook(
            lambda mod, args, out, store=seen[-1]: store.append(out.detach()))
    return seen


def train_gpt(model: GPT, seeds: tuple[int, ...]) -> None:
    model.train()
    for seed in seeds:
        tokens = batch(seed)
        model(tokens).sum().backward()


def test_gpt_counts_equal_the_router_logits_count():
    model = gpt()
    load, logits = RouterLoad.attach(model), gpt_router_logits(model)
    train_gpt(model, (1, 2))
    hand = [sum(by_hand(step) for step in layer) for layer in logits]
    assert len(hand) == 2 and all(int(c.sum()) == 2 * 2 * LENGTH * TOP_K for c in hand)
    for counted, expected in zip(load.counts(), hand):
        assert torch.equal(counted, expected)
    assert load.epoch_metrics() == pytest.approx(expected_metrics(hand))


@pytest.mark.parametrize("family", FAMILIES)
def test_hf_counts_equal_the_router_logits_count(family):
    model = hf(family).train()
    load = RouterLoad.attach(model)
    assert load is not None
    hand = [torch.zeros(EXPERTS, dtype=torch.int64) for _ in range(2)]
    for seed in (1, 2):
        out = model(input_ids=batch(seed), labels=batch(seed))
        out.loss.backward()
        assert len(out.router_logits) == 2
        for layer, logits in enumerate(out.router_logits):
            hand[layer] += by_hand(logits)
    counted = load.counts()
    assert [c.tolist() for c in counted] == [c.tolist() for c in hand]
    assert load.epoch_metrics() == pytest.approx(expected_metrics(hand))


def test_evaluation_forwards_are_not_counted():
    model = gpt()
    load = RouterLoad.attach(model)
    model.eval()
    model(batch(1))
    model.train()
    with torch.no_grad():
        model(batch(2))
    assert all(int(c.sum()) == 0 for c in load.counts())
    train_gpt(model, (3,))
    assert all(int(c.sum()) == 2 * LENGTH * TOP_K for c in load.counts())


def test_activation_checkpointing_recompute_is_not_counted():
    model = gpt()
    apply_activation_checkpointing(model, "Block")
    load, logits = RouterLoad.attach(model), gpt_router_logits(model)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):  # recompute all of MoE
        train_gpt(model, (1,))
    assert all(len(layer) == 2 for layer in logits)  # forward + recompute both ran
    for counted, layer in zip(load.counts(), logits):
        assert torch.equal(counted, by_hand(layer[0]))


def test_hf_recompute_is_not_counted():
    model = hf("mixtral").train()
    apply_activation_checkpointing(model, "MixtralDecoderLayer")
    load = RouterLoad.attach(model)
    out = model(input_ids=batch(1), labels=batch(1))
    out.loss.backward()
    hand = [by_hand(logits) for logits in out.router_logits]
    assert [c.tolist() for c in load.counts()] == [c.tolist() for c in hand]


def test_epoch_metrics_reset_the_counts():
    model = gpt()
    load = RouterLoad.attach(model)
    train_gpt(model, (1,))
    first = load.epoch_metrics()
    assert first["router_tokens_per_expert_max"] > 0 and first["router_max_over_mean_load"] >= 1
    assert all(int(c.sum()) == 0 for c in load.counts())
    empty = load.epoch_metrics()
    assert math.isnan(empty["router_max_over_mean_load"])
    assert empty["router_tokens_per_expert_min"] == empty["router_tokens_per_expert_max"] == 0
    train_gpt(model, (1,))
    assert load.epoch_metrics() == pytest.approx(first)


def test_models_without_experts_get_none():
    assert RouterLoad.attach(gpt(experts=0)) is None
    assert RouterLoad.attach(torch.nn.Linear(2, 2)) is None


def test_close_removes_the_hooks():
    model = gpt()
    load = RouterLoad.attach(model)
    load.close()
    train_gpt(model, (1,))
    assert all(int(c.sum()) == 0 for c in load.counts())


def group_worker(rank, world_size):
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        model = gpt()
        load = RouterLoad.attach(model)
        train_gpt(model, (10 + rank,))
        local = [c.clone() for c in load.counts()]
        return local, load.epoch_metrics()
    finally:
        dist.destroy_process_group()


def test_two_ranks_sum_their_counts():
    results = spawn(group_worker, 2)
    model = gpt()
    logits = gpt_router_logits(model)
    train_gpt(model, (10, 11))  # both ranks' batches in one process
    hand = [sum(by_hand(step) for step in layer) for layer in logits]
    for rank, (local, metrics) in enumerate(results):
        assert [c.tolist() for c in local] != [c.tolist() for c in hand]  # a rank's share
        assert metrics == pytest.approx(expected_metrics(hand)), rank
    summed = [a + b for a, b in zip(results[0][0], results[1][0])]
    assert [c.tolist() for c in summed] == [c.tolist() for c in hand]


def test_a_runs_epoch_row_carries_the_router_load():
    import paratrain
    from paratrain.testing.language import token_dataset

    with paratrain.Run(strategy="single", progress=False, accelerator="cpu") as run:
        model = gpt()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = run.prepare(model, optimizer)
        loader = run.loader(token_dataset(8, VOCAB, LENGTH), batch_size=4)
        for _ in run.epochs(1):
            for x, y in loader:
                logits = model(x)
                run.backward(torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()))
                run.step(optimizer)
        row = run.epoch_stats[0]
    # 8 sequences x block tokens x top_k copies per layer, shared by the 4 experts.
    assert row["router_max_over_mean_load"] >= 1.0
    assert row["router_tokens_per_expert_min"] <= row["router_tokens_per_expert_max"]
    assert row["router_tokens_per_expert_max"] <= 8 * LENGTH * TOP_K
