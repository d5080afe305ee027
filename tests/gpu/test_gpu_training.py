"""Strategies and precisions on one CUDA device, against the same run on ``single``."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.strategies.capabilities import local_module
from paratrain.testing.reference import synthetic_classification, train_steps

pytestmark = pytest.mark.gpu


def mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                         nn.Linear(32, 3))


def run_steps(strategy, *, precision="32", num_steps=4, num_epochs=1, mean_losses=True):
    run = paratrain.Run(strategy=strategy, accelerator="cuda", precision=precision,
                        progress=False, seed=5)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = run.prepare(model, optimizer)
    assert run.device.type == "cuda"
    assert all(p.device.type == "cuda" for p in model.parameters())
    loader = run.loader(synthetic_classification(64), batch_size=16)
    losses = train_steps(run, model, optimizer, loader, num_steps=num_steps,
                         num_epochs=num_epochs, mean_losses=mean_losses)
    params = {k: v.detach().float().cpu()
              for k, v in local_module(run.strategy, model).state_dict().items()}
    run.close()
    return params, losses


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "hybrid", "dp"])
def test_one_gpu_strategies_match_single(strategy):
    """A one-process job falls back to one device and computes what ``single`` computes."""
    ref_params, ref_losses = run_steps("single")
    params, losses = run_steps(strategy)
    assert losses == pytest.approx(ref_losses, abs=1e-5)
    assert params.keys() == ref_params.keys()
    for name, value in params.items():
        torch.testing.assert_close(value, ref_params[name], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("precision, param_dtype, output_dtype", [
    ("32", torch.float32, torch.float32),
    ("bf16-mixed", torch.float32, torch.bfloat16),
    ("16-mixed", torch.float32, torch.float16),
    ("bf16-true", torch.bfloat16, torch.float32),
])
def test_precisions_train_on_cuda(precision, param_dtype, output_dtype):
    if "bf16" in precision and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    run = paratrain.Run(strategy="single", accelerator="cuda", precision=precision,
                        progress=False, seed=5)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = run.prepare(model, optimizer)
    assert {p.dtype for p in model.parameters()} == {param_dtype}
    loader = run.loader(synthetic_classification(64), batch_size=16)
    losses = []
    for _ in run.epochs(2):
        for x, y in loader:
            out = model(x)
            assert out.is_cuda and out.dtype == output_dtype
            loss = F.cross_entropy(out.float(), y)
            run.backward(loss)
            run.step(optimizer)
            losses.append(loss.item())
    run.close()
    assert run.precision.skipped_steps == 0
    # Same data, same initial weights: each precision follows the float32 run closely.
    _, reference = run_steps("single", num_steps=4, num_epochs=2, mean_losses=True)
    tolerance = 1e-5 if precision == "32" else 5e-2
    assert losses == pytest.approx(reference, abs=tolerance)


@pytest.mark.parametrize("overflow", ["inf_gradient", "huge_loss"])
def test_16_mixed_skips_the_step_and_backs_off_on_overflow(overflow):
    run = paratrain.Run(strategy="single", accelerator="cuda", precision="16-mixed",
                        progress=False, seed=5)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = run.prepare(model, optimizer)
    x, y = synthetic_classification(16).tensors
    x, y = x.cuda(), y.cuda()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    scale = run.precision.scaler.get_scale()
    loss = F.cross_entropy(model(x).float(), y)
    if overflow == "huge_loss":
        # Times the scale (65536) this overflows float16 in the backward matmuls.
        loss = loss * 1e30
    run.backward(loss)
    if overflow == "inf_gradient":
        next(model.parameters()).grad.view(-1)[0] = float("inf")
    assert run.step(optimizer)  # the group ended, but the update was skipped
    assert run.precision.skipped_steps == 1
    assert run.precision.scaler.get_scale() == scale * 0.5
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed in a skipped step"
    # The next, finite step goes through at the reduced scale.
    run.backward(F.cross_entropy(model(x).float(), y))
    run.step(optimizer)
    assert run.precision.skipped_steps == 1
    assert not torch.equal(model.state_dict()["0.weight"], before["0.weight"])
    run.close()
