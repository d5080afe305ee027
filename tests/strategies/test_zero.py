"""``zero1`` and ``zero2`` train as ``ddp`` does (Adam, accumulation, clipping), with the
optimizer state (and for ``zero2`` the gradients) sharded; ``fsdp``'s CPU offload trains
as ``fsdp`` does."""

from __future__ import annotations

import dataclasses
import datetime
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.parallel.options import Sharding as FSDPOptions
from paratrain.parallel.presets import ZeroTwoOptions as Zero2Options
from paratrain.parallel.presets import preset
from paratrain.strategies.capabilities import ShardedState
from paratrain.strategies.zero.zero1 import shard_optimizer
from paratrain.testing.numerics import TrainingBound, assert_params_within
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification

STEPS, ACCUMULATE, GLOBAL_BATCH = 3, 2, 8
# (strategy, options) per case; "fsdp-offload" is fsdp with CPUOffloadPolicy.
CASES = {"ddp": ("ddp", {}), "zero1": ("zero1", {}), "zero2": ("zero2", {}),
         "fsdp": ("fsdp", {}), "fsdp-offload": ("fsdp", {"offload": True})}


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def local_numel(tensors) -> int:
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() for t in tensors
               if isinstance(t, torch.Tensor) and t.dim() > 0)


def train(case: str) -> dict:
    strategy, options = CASES[case]
    # max_grad_norm well under the gradients' norm: every step is clipped.
    with paratrain.Run(strategy=strategy, strategy_options=options, accelerator="cpu",
                       progress=False, seed=5, accumulate=ACCUMULATE,
                       max_grad_norm=0.05) as run:
        model = mlp()
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        bound = TrainingBound(model, optimizer) if case == "ddp" else None
        model, optimizer = run.prepare(model, optimizer)
        loader = run.loader(synthetic_classification(64),
                            batch_size=GLOBAL_BATCH // run.strategy.data_parallel_size)
        grads = 0
        for _, (x, y) in zip(range(STEPS * ACCUMULATE), loader):
            run.backward(F.cross_entropy(model(x), y))
            grads = local_numel(p.grad for p in model.parameters())
            run.step(optimizer)
        local_optimizer = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's shard
        moments = local_numel(v for s in local_optimizer.state.values() for v in s.values())
        state = (run.strategy.full_state_dict(model) if isinstance(run.strategy, ShardedState)
                 else run.strategy.unwrap(model).state_dict())
        return {"params": {k: v.detach().clone() for k, v in state.items()},
                "grads": grads, "moments": moments,
                "tolerances": bound.tolerances() if bound else None}


def zero_worker(rank, world_size):
    # One group for every case: process start-up dominates these tiny runs.
    dist.init_process_group("gloo", rank=int(os.environ["RANK"]), world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    return {case: train(case) for case in CASES}


@pytest.mark.slow
def test_zero_stages_and_offload_train_as_ddp_with_sharded_state():
    results = spawn(zero_worker, 2, timeout=300)
    total = sum(v.numel() for v in mlp().parameters())
    for rank in results:
        ddp = rank["ddp"]
        # ZeRO-1 steps the same averaged, clipped gradient with the same arithmetic:
        # bitwise equal.
        for key, value in ddp["params"].items():
            assert torch.equal(rank["zero1"]["params"][key], value), key
        # ZeRO-2 reduce-scatters instead of all-reducing and clips by a norm summed from
        # shards: rounded differently, within what float32 and Adam's arithmetic allow
        # (paratrain.testing.numerics, replayed on the ddp run).
        assert_params_within(rank["zero2"]["params"], ddp["params"], ddp["tolerances"])
        # ... and is fsdp with reshard_after_forward=False: bitwise fsdp's.
        for key, value in rank["fsdp"]["params"].items():
            assert torch.equal(rank["zero2"]["params"][key], value), key
        # Offload moves where the shards live, not what is computed.
        for key, value in rank["fsdp"]["params"].items():
            assert torch.equal(rank["fsdp-offload"]["params"][key], value), key
        # Adam's two moments: 2x the parameters under ddp, about half of that per rank
        # when sharded (zero1 splits whole tensors, so the halves are uneven).
        assert ddp["moments"] == 2 * total and ddp["grads"] == total
        assert 0 < rank["zero1"]["moments"] < 2 * total and rank["zero1"]["grads"] == total
        assert rank["zero2"]["moments"] <= 1.1 * total and rank["zero2"]["grads"] <= 0.55 * total
    assert sum(r["zero1"]["moments"] for r in results) == 2 * total


def test_options_are_validated_in_one_line():
    with pytest.raises(ValueError, match="offload must be True or False"):
        FSDPOptions(offload="yes")
    with pytest.raises(ValueError, match="offload must be True or False"):
        preset("zero2", Zero2Options(offload=1), local_world_size=2)
    assert preset("zero2", {}, local_world_size=2).sharding.reshard_after_forward is False
    with pytest.raises(TypeError):
        Zero2Options(reshard_after_forward=True)  # fixed by the strategy


def test_zero2_offers_every_fsdp_option_but_the_one_it_fixes():
    # A new Sharding field reaches zero2 too (its options are generated from Sharding's).
    fsdp_fields = {f.name for f in dataclasses.fields(FSDPOptions)}
    zero2_fields = {f.name for f in dataclasses.fields(Zero2Options)}
    assert zero2_fields == fsdp_fields - {"reshard_after_forward"}


def test_zero1_refuses_an_optimizer_that_has_state():
    model = nn.Linear(2, 1)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(ValueError, match="has not stepped yet"):
        shard_optimizer(optimizer)
