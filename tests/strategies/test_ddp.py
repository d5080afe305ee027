"""DDP on 2 gloo ranks against a single-process reference."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.testing.numerics import (
    REASSOCIATION,
    TrainingBound,
    assert_gradients_within,
    assert_losses_within,
    assert_params_within,
)
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification, train_steps

NUM_SAMPLES = 96


def dataset(n=NUM_SAMPLES):
    return synthetic_classification(n)


def mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


def train(strategy, batch_size, num_steps, options=None):
    run = paratrain.Run(strategy=strategy, progress=False, accelerator="cpu", seed=7,
                        strategy_options=options or {})
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    bound = TrainingBound(model, optimizer) if strategy == "single" else None
    model, optimizer = run.prepare(model, optimizer)
    loader = run.loader(dataset(), batch_size=batch_size)
    losses = train_steps(run, model, optimizer, loader, num_steps=num_steps,
                         num_epochs=2)
    params = {k: v.detach().clone() for k, v in run.strategy.unwrap(model).state_dict().items()}
    run.close()
    return params, losses, bound


def ddp_worker(rank, world_size, batch_size, num_steps, options):
    return train("ddp", batch_size, num_steps, options)


@pytest.mark.parametrize("options", [{}, {"bucket_cap_mb": 0.001}])
def test_ddp_matches_single_process_with_global_batch(options):
    ref_params, ref_losses, bound = train("single", 8, 5)
    results = spawn(ddp_worker, 2, 4, 5, options)
    for params, losses, _ in results:
        # Two half-batches averaged: the batch's sums in another order, carried through
        # SGD's arithmetic (paratrain.testing.numerics).
        assert set(params) == set(ref_params)
        assert_params_within(params, ref_params, bound)
        assert_losses_within(losses, ref_losses)
    # The ranks hold bitwise identical replicas.
    for name in ref_params:
        assert torch.equal(results[0][0][name], results[1][0][name])


def grads_worker(rank, world_size):
    run = paratrain.Run(strategy="ddp", progress=False, accelerator="cpu", seed=7)
    model = run.prepare(mlp())
    x, y = dataset().tensors
    shard = slice(rank * 8, (rank + 1) * 8)
    run.backward(F.cross_entropy(model(x[shard]), y[shard]))
    grads = [p.grad.clone() for p in model.parameters()]
    run.close()
    return grads


def test_gradients_equal_reference_after_sync():
    torch.manual_seed(7)
    model = mlp()
    x, y = dataset().tensors
    F.cross_entropy(model(x[:16]), y[:16]).backward()
    reference = {str(i): p.grad for i, p in enumerate(model.parameters())}
    for grads in spawn(grads_worker, 2):
        assert_gradients_within({str(i): g for i, g in enumerate(grads)}, reference)


def eval_worker(rank, world_size):
    run = paratrain.Run(strategy="ddp", progress=False, accelerator="cpu", seed=7)
    model = run.prepare(mlp())
    result = run.evaluate(model, run.eval_loader(dataset(101), batch_size=16))
    run.close()
    return result


def test_evaluation_over_ranks_is_exact():
    run = paratrain.Run(strategy="single", progress=False, accelerator="cpu", seed=7)
    model = run.prepare(mlp())
    reference = run.evaluate(model, run.eval_loader(dataset(101), batch_size=16))
    run.close()
    for world_size in (2, 3):
        for result in spawn(eval_worker, world_size):
            assert result["count"] == 101
            assert result["accuracy"] == reference["accuracy"]
            # A sum of positive per-sample losses in another order.
            assert result["loss"] == pytest.approx(reference["loss"], rel=REASSOCIATION)


def collectives_worker(rank, world_size):
    run = paratrain.Run(strategy="ddp", progress=False, accelerator="cpu")
    out = (run.mean(torch.tensor(float(rank))), run.sum(rank + 1),
           run.gather(torch.tensor([rank, 10 * rank])).tolist())
    run.close()
    return out


def test_mean_sum_gather():
    for mean, total, gathered in spawn(collectives_worker, 3):
        assert mean == pytest.approx(1.0)
        assert total == 6
        assert gathered == [[0, 0], [1, 10], [2, 20]]
