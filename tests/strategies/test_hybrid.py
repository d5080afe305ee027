"""Hybrid layouts on 4 gloo ranks against a single-process reference: 2 DP x 2 PP and HSDP."""

import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.distributed.topology import Topology
from paratrain.parallel.presets import HybridOptions, preset
from paratrain.strategies.capabilities import ShardedState
from paratrain.testing.numerics import TrainingBound, assert_losses_within, assert_params_within
from paratrain.testing.pool import spawn
from paratrain.testing.reference import train_steps


def dataset(n=64):
    g = torch.Generator().manual_seed(4321)
    x = torch.randn(n, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def train(strategy, batch_size, options=None, num_steps=4):
    run = paratrain.Run(strategy=strategy, progress=False, accelerator="cpu", seed=3,
                        strategy_options=options or {})
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    bound = TrainingBound(model, optimizer) if strategy == "single" else None
    model, optimizer = run.prepare(model, optimizer)
    loader = run.loader(dataset(), batch_size=batch_size)
    losses = train_steps(run, model, optimizer, loader, num_steps=num_steps,
                         num_epochs=1)
    strategy = run.strategy
    state = (strategy.full_state_dict(model) if isinstance(strategy, ShardedState)
             else strategy.unwrap(model).state_dict())
    params = {k: v.detach().clone() for k, v in state.items()}
    layout = (run.strategy.data_parallel_size, run.strategy.data_parallel_rank)
    run.close()
    return params, losses, layout, bound


def dp_pp_worker(rank, world_size):
    return train("hybrid", 4, {"pipeline_degree": 2, "pipeline": {"schedule": "1f1b",
                                                                  "num_microbatches": 2}})


def hsdp_worker(rank, world_size):
    # Pretend 2 nodes of 2 processes: the launcher would set these per node.
    os.environ.update(LOCAL_RANK=str(rank % 2), GROUP_RANK=str(rank // 2))
    return train("hybrid", 2)


def test_degrees_are_inferred_and_validated_once():
    topology = Topology(rank=0, world_size=8, local_world_size=4, num_nodes=2)
    def degrees(**options):
        return preset("hybrid", options, local_world_size=topology.local_world_size).resolve(
            world_size=topology.world_size, local_world_size=topology.local_world_size)

    hsdp = degrees()
    assert (hsdp.pipeline_degree, hsdp.replicate_degree, hsdp.shard_degree) == (1, 2, 4)
    dp_pp = degrees(pipeline_degree=4)
    assert (dp_pp.replicate_degree, dp_pp.shard_degree) == (2, 1)
    with pytest.raises(ValueError, match="pp=3 does not divide the world size 8"):
        degrees(pipeline_degree=3)
    with pytest.raises(ValueError, match="pipeline options need pipeline_degree > 1"):
        HybridOptions(pipeline={"schedule": "gpipe"})


@pytest.mark.slow
@pytest.mark.parametrize("worker, per_rank_batch, env", [
    (dp_pp_worker, 4, {}),
    (hsdp_worker, 2, {"LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}),
], ids=["2dp_x_2pp", "hsdp_2x2"])
def test_hybrid_matches_single_process(worker, per_rank_batch, env):
    ref_params, ref_losses, _, bound = train("single", 8)
    results = spawn(worker, 4, env=env, timeout=240)
    covered = set()
    for params, losses, (dp_size, _), _ in results:
        assert dp_size * per_rank_batch == 8
        # Bounds from float32 arithmetic and Adam's (paratrain.testing.numerics), per
        # element: Adam divides a gradient's rounding difference by its size.
        assert_params_within(params, ref_params, bound)
        covered.update(params)
        assert_losses_within(losses, ref_losses)
    assert covered == set(ref_params)
    assert sorted(layout for _, _, layout, _ in results) == sorted(
        (8 // per_rank_batch, r) for r in range(8 // per_rank_batch)
        for _ in range(4 // (8 // per_rank_batch)))
