"""``hybrid``'s layouts with a pipeline inside: pipeline x FSDP, pipeline x TP and the
3-D pipeline x FSDP x TP, on gloo ranks against one process training the same GPT.

The 2-D layouts (and pipeline x HSDP) are in the degree grid,
tests/parallel/test_degree_grid.py; here the 3-D layout also saves and resumes."""

import logging

import pytest
import torch

import paratrain
from paratrain.distributed.topology import Topology
from paratrain.models import GPT
from paratrain.parallel.presets import HybridOptions, preset
from paratrain.testing.language import (
    evaluate_tokens,
    layout_meshes,
    token_dataset,
    train_steps,
    whole_state,
)
from paratrain.testing.numerics import (
    REASSOCIATION,
    TrainingBound,
    assert_losses_within,
    assert_params_within,
)
from paratrain.testing.pool import spawn

VOCAB, BLOCK, STEPS, GLOBAL_BATCH = 16, 8, 3, 8


def gpt():
    return GPT(vocab_size=VOCAB, block_size=BLOCK, n_layer=4, n_head=4, n_embd=16)


def tokens(n=48):
    return token_dataset(n, VOCAB, BLOCK)


def train(strategy, options, checkpoint_dir=None):
    run = paratrain.Run(strategy=strategy, strategy_options=options, progress=False,
                        accelerator="cpu", seed=5, max_grad_norm=0.5)
    torch.manual_seed(0)
    model = gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # The reference replays Adam's arithmetic: how far another layout may drift.
    bound = TrainingBound(model, optimizer) if strategy == "single" else None
    model, optimizer = run.prepare(model, optimizer)
    strategy = run.strategy
    loader = run.loader(tokens(), batch_size=GLOBAL_BATCH // strategy.data_parallel_size)
    losses = train_steps(run, model, optimizer, loader, STEPS)
    # 13 held-out sequences: the data-parallel ranks get unequal shares, so a sharded
    # stage's evaluation must pad in lockstep.
    evaluation = evaluate_tokens(run, model, tokens(13))
    saved = run.save(checkpoint_dir) if checkpoint_dir else None
    result = {"losses": losses, "meshes": layout_meshes(model), "evaluation": evaluation,
              "params": whole_state(run, model), "saved": saved, "bound": bound,
              "data_parallel": (strategy.data_parallel_size, strategy.data_parallel_rank)}
    run.close()
    return result


def worker(rank, world_size, options, checkpoint_dir=None):
    # What DTensor logs while redistributing ("... sequential all_gather operations ...").
    messages = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("torch.distributed.tensor._redistribute").addHandler(handler)
    return {**train("hybrid", options, checkpoint_dir), "dtensor_log": messages}


@pytest.fixture(scope="module")
def reference():
    return train("single", {})


def assert_matches(result, reference):
    # Bounds from float32 arithmetic and Adam's (paratrain.testing.numerics): Adam
    # turns a rounding difference in a ~0 gradient (the key biases) into an lr-sized
    # parameter difference, so each element gets the bound its own gradient allows.
    assert_losses_within(result["losses"], reference["losses"])
    assert result["evaluation"]["count"] == reference["evaluation"]["count"] == 13 * BLOCK
    assert result["evaluation"]["loss"] == pytest.approx(reference["evaluation"]["loss"],
                                                         rel=REASSOCIATION)
    assert result["params"].keys() == reference["params"].keys()
    assert_params_within(result["params"], reference["params"], reference["bound"])


def test_three_axes_are_inferred_and_checked_once():
    topology = Topology(rank=0, world_size=8, local_world_size=8, num_nodes=1)
    def degrees(**options):
        return preset("hybrid", options, local_world_size=8).resolve(world_size=8)

    assert degrees(pipeline_degree=2, shard_degree=2, tensor_degree=2).shape == (2, 1, 2, 1, 2)
    assert degrees(pipeline_degree=2, tensor_degree=2).shape == (2, 2, 1, 1, 2)
    # Replicas x tensor parallel without a pipeline: HSDP with shard 1 over the replicas.
    assert degrees(tensor_degree=2, shard_degree=1).shape == (1, 4, 1, 1, 2)
    with pytest.raises(ValueError, match="tensor_degree must be an integer >= 1, got 0"):
        HybridOptions(pipeline_degree=2, tensor_degree=0)
    with pytest.raises(ValueError, match="fsdp options inside a pipeline need shard_degree > 1"):
        HybridOptions(pipeline_degree=2, fsdp={"reshard_after_forward": False})
    with pytest.raises(ValueError, match="tp=3 does not divide the world size 8"):
        degrees(pipeline_degree=2, tensor_degree=3)
    with pytest.raises(ValueError, match="cannot fill the world"):
        degrees(pipeline_degree=2, shard_degree=2, tensor_degree=4)
    from paratrain.strategies import create_strategy

    with pytest.raises(ValueError, match="sequence_parallel and loss_parallel are not supported "
                                         "on pipeline stages"):
        create_strategy("hybrid", topology, {"pipeline_degree": 2, "tensor_degree": 2,
                                             "tensor": {"sequence_parallel": True}})


@pytest.mark.slow
def test_three_d_on_eight_ranks_matches_single_and_resumes_in_one_process(reference, tmp_path):
    options = {"pipeline_degree": 2, "shard_degree": 2, "tensor_degree": 2,
               "pipeline": {"schedule": "gpipe", "num_microbatches": 2}}
    results = spawn(worker, 8, options, str(tmp_path), timeout=420)
    for result in results:
        assert_matches(result, reference)
        # FSDP over the tensor-parallel pieces: 2-D DTensors; norms and layer norms
        # (not in the plan) are sharded over the data axis only.
        assert result["meshes"] == {("shard", "tensor"), ("shard",)}
        # ... gathered whole in one all_gather each (full_state_dict), not one per axis.
        assert not [m for m in result["dtensor_log"] if "sequential" in m]
    # Saved by 8 ranks (stages x shards x tensor pieces), resumed by one process.
    resumed = paratrain.Run(strategy="single", progress=False, accelerator="cpu", seed=5)
    model = gpt()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = resumed.prepare(model, optimizer)
    resumed.load(results[0]["saved"])
    # A checkpoint round trip computes nothing: bitwise what the 8 ranks saved.
    for name, value in results[0]["params"].items():
        assert torch.equal(model.state_dict()[name], value), name
    assert resumed.global_step == STEPS and len(optimizer.state) == len(reference["params"])
    resumed.close()
