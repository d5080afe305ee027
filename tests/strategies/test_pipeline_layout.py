"""Pipelines for models that are not nn.Sequential: the GPT cut by its PipelineLayout."""

import pytest
import torch
from torch import nn

import paratrain
from paratrain.models import GPT
from paratrain.strategies.capabilities import ShardedState
from paratrain.strategies.pipeline.layout import (
    PipelineLayout,
    block_ranges,
    cut_stage,
    layout_of,
    measure_costs,
    ranges_from_points,
    split_model,
)
from paratrain.testing.language import evaluate_tokens, token_dataset, train_steps
from paratrain.testing.numerics import TrainingBound, assert_losses_within, assert_params_within
from paratrain.testing.pool import spawn

VOCAB, BLOCK = 11, 8


def gpt():
    return GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=4, n_head=2, n_embd=16)


def tokens(n=48):
    return token_dataset(n, VOCAB, BLOCK, seed=3)


def test_block_ranges_follow_the_measured_costs():
    # Equal blocks split in the middle; a costly first block (embedding included)
    # gets a stage of its own, a costly head pulls the cut towards the end.
    assert block_ranges([1.0, 1.0, 1.0, 1.0], 2) == [range(0, 2), range(2, 4)]
    assert block_ranges([3.0, 1.0, 1.0, 1.0], 2) == [range(0, 1), range(1, 4)]
    assert block_ranges([1.0, 1.0, 1.0, 2.5], 2) == [range(0, 3), range(3, 4)]
    assert block_ranges([1.0] * 6, 3) == [range(0, 2), range(2, 4), range(4, 6)]
    assert ranges_from_points(4, 2, (3,)) == [range(0, 3), range(3, 4)]
    with pytest.raises(ValueError, match="split_points=\\(4,\\) must give 1 block"):
        ranges_from_points(4, 2, (4,))


def test_stages_keep_full_names_and_together_equal_the_model():
    torch.manual_seed(0)
    full = gpt()
    x = torch.randint(VOCAB, (3, BLOCK))
    expected = full(x)
    names = {n for n, _ in full.named_parameters()}
    stages = [range(0, 1), range(1, 4)]
    torch.manual_seed(0)
    first = cut_stage(gpt(), layout_of(gpt()), stages, [0])
    torch.manual_seed(0)
    last = cut_stage(gpt(), layout_of(gpt()), stages, [1])
    first_names = {n for n, _ in first.named_parameters()}
    last_names = {n for n, _ in last.named_parameters()}
    assert "tok_emb.weight" in first_names and "blocks.0.attn.q.weight" in first_names
    assert "blocks.3.mlp.proj.weight" in last_names and "head.weight" in last_names
    assert not first_names & last_names and first_names | last_names == names
    torch.testing.assert_close(last(first(x)), expected, rtol=0, atol=0)
    # Two stages per rank: chunks 0 and 2 of 4 share their parts with the rank's whole.
    torch.manual_seed(0)
    whole, chunks, _ = split_model(gpt(), layout_of(gpt()), num_stages=4, stage_indices=[0, 2],
                                   split_points=(1, 2, 3), device=torch.device("cpu"), agree=None)
    assert {n for n, _ in whole.named_parameters()} == {
        n for c in chunks for n, _ in c.named_parameters()}
    assert chunks[0].head is None and chunks[1].tok_emb is None and whole.head is None
    assert [n for n, _ in chunks[1].blocks.named_children()] == ["2"]
    assert dict(chunks[1].blocks.named_children())["2"] is dict(whole.blocks.named_children())["2"]


class NormedStack(nn.Module):
    """BatchNorm before a stack of blocks: measuring must not move its running statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.norm(x) if self.norm is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x

    def pipeline_layout(self):
        return PipelineLayout(before=("norm",), blocks="blocks", after=("head",),
                              sample_input=torch.randn(4, 8))


def test_measuring_leaves_no_trace():
    model = GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=4, n_head=2, n_embd=16, dropout=0.1)
    layout = layout_of(model)
    state = torch.random.get_rng_state()
    costs = measure_costs(model, layout, torch.device("cpu"), repeats=1)
    assert len(costs) == 4 and all(c > 0 for c in costs)
    # Dropout draws from the generator: only the restored state makes this hold.
    assert torch.equal(torch.random.get_rng_state(), state)
    assert all(p.grad is None for p in model.parameters())

    normed = NormedStack()
    buffers = {k: v.clone() for k, v in normed.named_buffers()}
    measure_costs(normed, layout_of(normed), torch.device("cpu"), repeats=1)
    assert all(torch.equal(v, buffers[k]) for k, v in normed.named_buffers())


def test_bad_layouts_are_refused_in_one_line():
    with pytest.raises(ValueError, match="names \\['head'\\] in two places"):
        PipelineLayout(before=("head",), blocks="blocks", after=("head",))

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(nn.Linear(2, 2))

        def pipeline_layout(self):
            return PipelineLayout(before=(), blocks="blocks", after=())

    with pytest.raises(ValueError, match="Flat.blocks must be an nn.ModuleList"):
        layout_of(Flat())


def test_an_embedding_tied_to_the_head_on_another_stage_is_reported():
    model = gpt()
    model.head.weight = shared = model.tok_emb.weight  # weight tying, as GPT-2 does
    parts = split_model(model, layout_of(model), num_stages=2, stage_indices=[1],
                        split_points=(2,), device=torch.device("cpu"), agree=None)
    # The strategy keeps the two copies equal (tests/strategies/test_pipeline_ties.py).
    assert parts.ties == ((("tok_emb.weight", 0), ("head.weight", 1)),)
    assert parts.whole.head.weight is shared and parts.whole.tok_emb is None
    # Blocks tied within one stage are fine.
    model = gpt()
    model.blocks[1].mlp.proj.weight = model.blocks[0].mlp.proj.weight
    stage = split_model(model, layout_of(model), num_stages=2, stage_indices=[0],
                        split_points=(2,), device=torch.device("cpu"), agree=None).whole
    assert stage.blocks[1].mlp.proj.weight is stage.blocks[0].mlp.proj.weight


def train(strategy, num_steps, schedule):
    run = paratrain.Run(strategy=strategy, progress=False, accelerator="cpu", seed=5,
                        strategy_options={"schedule": schedule, "num_microbatches": 4}
                        if strategy == "pipeline" else {})
    model = gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    bound = TrainingBound(model, optimizer) if strategy == "single" else None
    model, optimizer = run.prepare(model, optimizer)
    losses = train_steps(run, model, optimizer, run.loader(tokens(), batch_size=8), num_steps)
    evaluation = evaluate_tokens(run, model, tokens(13))
    strategy = run.strategy
    module = (strategy.checkpoint_module(model) if isinstance(strategy, ShardedState)
              else strategy.unwrap(model))
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    run.close()
    return params, losses + [evaluation["loss"]], bound


def pipeline_worker(rank, world_size, schedule):
    # One Run per process, as in a real job: a second process group on the same
    # MASTER_PORT in one process can hang while joining.
    return train("pipeline", 4, schedule)


@pytest.mark.slow
def test_gpt_pipeline_matches_single_process_with_every_schedule():
    ref_params, ref_losses, bound = train("single", 4, None)
    for schedule in ("gpipe", "1f1b", "interleaved_1f1b", "zbv"):
        results = spawn(pipeline_worker, 2, schedule)
        seen = set()
        for params, losses, _ in results:
            # Bounds from float32 arithmetic and Adam's (paratrain.testing.numerics):
            # Adam turns a rounding difference in a ~0 gradient (the key biases) into
            # an lr-sized parameter difference; each element gets its own bound.
            assert_params_within(params, ref_params, bound)
            seen.update(params)
            assert_losses_within(losses, ref_losses)
        # The stages are disjoint and together hold the whole model.
        assert seen == set(ref_params)
        assert not set(results[0][0]) & set(results[1][0])
        blocks = [sorted({int(n.split(".")[1]) for n in params if n.startswith("blocks.")})
                  for params, _, _ in results]
        if schedule == "interleaved_1f1b":
            # 4 one-block stages in a loop: rank 0 runs stages 0 and 2.
            assert blocks == [[0, 2], [1, 3]]
        elif schedule == "zbv":
            # 4 one-block stages in a V: rank 0 runs stages 0 and 3 (embedding and head).
            assert blocks == [[0, 3], [1, 2]]
        else:
            assert all(b == list(range(b[0], b[-1] + 1)) for b in blocks)
