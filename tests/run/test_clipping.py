"""Gradient clipping by the global norm: across ranks, under accumulation and fp16 scaling."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.testing.numerics import REASSOCIATION, TrainingBound, assert_params_within
from paratrain.testing.pool import spawn

MAX_NORM = 0.05  # well below the gradient norm, so every step clips


def dataset():
    g = torch.Generator().manual_seed(9)
    x = torch.randn(32, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


def mlp():
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 2))


def reference(num_steps=4, batch_size=8):
    """Plain PyTorch: global batch, clip_grad_norm_, SGD."""
    torch.manual_seed(13)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    bound = TrainingBound(model, optimizer)
    x, y = dataset().tensors
    order = paratrain.data.epoch_order(32, seed=13, epoch=0, shuffle=True)
    norms = []
    for step in range(num_steps):
        index = order[step * batch_size:(step + 1) * batch_size]
        optimizer.zero_grad()
        F.cross_entropy(model(x[index]), y[index]).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()], norms, bound


def train(*, strategy="single", batch_size=8, accumulate=1, precision="32"):
    run = paratrain.Run(strategy=strategy, accelerator="cpu", progress=False, seed=13,
                        max_grad_norm=MAX_NORM, accumulate=accumulate, precision=precision)
    if precision == "16-mixed":
        # Start at a loss scale this tiny model does not overflow at, so no step is skipped.
        state = run.precision.scaler.state_dict() | {"scale": 1024.0}
        run.precision.load_state_dict({"scaler": state})
    model = mlp()
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    loader = run.loader(dataset(), batch_size=batch_size)
    norms = []
    for _ in run.epochs(1):
        for x, y in loader:
            run.backward(F.cross_entropy(model(x), y))
            if run.step(optimizer):
                norms.append(run.last_grad_norm)
    params = [p.detach().clone() for p in run.strategy.unwrap(model).parameters()]
    run.close()
    return params, norms


def assert_matches(result, expected):
    (params, norms), (ref_params, ref_norms, bound) = result, expected
    # Sums of the same squares in another order (ranks, micro-batches); the parameters
    # within what that rounding carries through SGD (paratrain.testing.numerics).
    assert norms == pytest.approx(ref_norms, rel=REASSOCIATION)
    assert min(ref_norms) > MAX_NORM  # every step really clipped
    names = [name for name, _ in mlp().named_parameters()]
    assert_params_within(dict(zip(names, params)), dict(zip(names, ref_params)), bound)


def test_clipping_matches_plain_pytorch():
    assert_matches(train(), reference())


def test_clipping_under_accumulation_uses_the_norm_of_the_whole_group():
    # Clipping each micro-batch's gradient would give other norms and updates.
    assert_matches(train(batch_size=2, accumulate=4), reference())


def test_clipping_with_fp16_measures_the_unscaled_gradient():
    params, norms = train(precision="16-mixed")
    ref_params, ref_norms, _ = reference()
    # Not 1024x larger: the scaler's factor was divided out before measuring. float16's
    # unit roundoff is 2**-11 (~4.9e-4): 2e-2 is ~40 of them, gradients of 16-term sums
    # rounded to half precision; 1024x (or a lost clip) would be far outside.
    for a, b in zip(params, ref_params):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-2)


def ddp_worker(rank, world_size):
    torch.distributed.init_process_group("gloo")
    return train(strategy="ddp", batch_size=4), train(strategy="ddp", batch_size=2, accumulate=2)


@pytest.mark.slow
def test_clipping_across_ranks_equals_single_process_global_norm():
    expected = reference()
    for plain, accumulated in spawn(ddp_worker, 2):
        assert_matches(plain, expected)
        assert_matches(accumulated, expected)
