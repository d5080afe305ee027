"""FSDP (fully_shard) on gloo ranks against a single-process reference; DCP checkpoints."""

import pytest
import torch
from torch import nn

import paratrain
from paratrain.parallel.options import Sharding as FSDPOptions
from paratrain.strategies.capabilities import ShardedState
from paratrain.strategies.fsdp import wrap_predicate
from paratrain.testing.numerics import (
    REASSOCIATION,
    TrainingBound,
    assert_losses_within,
    assert_params_within,
)
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification, train_steps

NUM_SAMPLES = 96


def dataset(n=NUM_SAMPLES):
    return synthetic_classification(n)


def mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(),
                         nn.Linear(16, 3))


def full_params(run, model):
    strategy = run.strategy
    state = (strategy.full_state_dict(model) if isinstance(strategy, ShardedState)
             else strategy.unwrap(model).state_dict())
    return {k: v.detach().clone() for k, v in state.items()}


def train(strategy, batch_size, num_steps, *, accumulate=2, checkpoint_dir=None, **kwargs):
    run = paratrain.Run(strategy=strategy, progress=False, accelerator="cpu", seed=7,
                        accumulate=accumulate, max_grad_norm=0.5, **kwargs)
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    bound = TrainingBound(model, optimizer) if strategy == "single" else None
    model, optimizer = run.prepare(model, optimizer)
    loader = run.loader(dataset(), batch_size=batch_size)
    losses = train_steps(run, model, optimizer, loader, num_steps=num_steps,
                         num_epochs=1)
    result = run.evaluate(model, run.eval_loader(dataset(101), batch_size=10))
    if checkpoint_dir is not None:
        run.save(checkpoint_dir)
    local = [p.to_local().numel() if hasattr(p, "to_local") else p.numel()
             for p in model.parameters()]
    params = full_params(run, model)
    run.close()
    return params, losses, result, sum(local), bound


def fsdp_worker(rank, world_size, checkpoint_dir=None):
    return train("fsdp", 8 // world_size, 6, checkpoint_dir=checkpoint_dir)


def test_wrap_policy_selects_blocks_and_rejects_bad_values():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.ModuleList([nn.Linear(2, 2)]))
    by_default = wrap_predicate(None, model)
    assert [by_default(m) for m in (model[0], model[1], model[2], model[2][0])] == [
        True, False, False, True]
    assert wrap_predicate("ReLU", model)(model[1]) and not wrap_predicate(nn.ReLU, model)(model[0])
    with pytest.raises(ValueError, match="wrap_policy must be"):
        FSDPOptions(wrap_policy=3)


@pytest.mark.slow
def test_fsdp_matches_single_process_and_shards_state(tmp_path):
    ref_params, ref_losses, ref_eval, ref_numel, bound = train("single", 8, 6)
    results = spawn(fsdp_worker, 2, str(tmp_path / "ckpt"))
    for params, losses, evaluation, local_numel, _ in results:
        # Bounds from float32 arithmetic and Adam's (paratrain.testing.numerics), per
        # element: Adam divides a gradient's rounding difference by its size.
        assert set(params) == set(ref_params)
        assert_params_within(params, ref_params, bound)
        assert_losses_within(losses, ref_losses)
        # Uneven eval shards (51 / 50 samples): exact, and no hang.
        assert evaluation["count"] == 101
        assert evaluation["accuracy"] == ref_eval["accuracy"]
        assert evaluation["loss"] == pytest.approx(ref_eval["loss"], rel=REASSOCIATION)
        # Each rank holds about half of the parameters (dim-0 shards, padded).
        assert local_numel <= 0.55 * ref_numel
    saved = results[0][0]
    # The sharded checkpoint written at world size 2 loads at 1 (here) and at 4.
    checkpoint = sorted((tmp_path / "ckpt").glob("step-*.pt"))[-1]
    assert checkpoint.with_suffix(".dcp").is_dir()
    for params in [load_worker(0, 1, str(checkpoint)), *spawn(load_worker, 4, str(checkpoint))]:
        for name, ref in saved.items():
            assert torch.equal(params[name], ref), name


def load_worker(rank, world_size, path):
    run = paratrain.Run(strategy="fsdp", progress=False, accelerator="cpu", seed=99)
    model = mlp()
    model, optimizer = run.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    run.load(path)
    params = full_params(run, model)
    # Optimizer state came back too: Adam's step counter and first moment.
    state = next(iter(optimizer.state.values()))
    assert int(state["step"]) == 3
    assert float(state["exp_avg"].abs().sum()) > 0
    assert run.global_step == 3
    run.close()
    return params
