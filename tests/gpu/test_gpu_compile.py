"""On CUDA: the default step never waits for the device, and CUDA graphs train."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain

pytestmark = pytest.mark.gpu


def mlp():
    return nn.Sequential(nn.Linear(10, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                         nn.Linear(64, 3))


def batches(num, device):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(num, 16, 10, generator=g)
    # On the device before the measured steps: a copy from pageable memory would sync.
    return [(xb.to(device), (xb[:, 0] > 0).long().to(device)) for xb in x]


def test_default_step_has_no_device_to_host_sync():
    run = paratrain.Run(strategy="single", accelerator="cuda", max_grad_norm=1.0, seed=3)
    model = mlp()
    model, optimizer = run.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    data = batches(6, run.device)
    steps = iter(run.progress(data))
    for x, y in [next(steps)]:  # warm-up: FLOP counting, optimizer state
        run.backward(F.cross_entropy(model(x), y))
        run.step(optimizer)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in steps:
            run.backward(F.cross_entropy(model(x), y))
            run.step(optimizer)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert run.global_step == 6
    assert run.last_grad_norm > 0  # read after the steps, where waiting is fine
    run.close()


def train(compile, capsys):
    run = paratrain.Run(strategy="single", accelerator="cuda", progress=False, seed=3,
                        compile=compile)
    model = mlp()
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    losses = []
    for x, y in batches(6, run.device):
        loss = F.cross_entropy(model(x), y)
        run.backward(loss)
        run.step(optimizer)
        losses.append(loss.item())
    run.close()
    return losses, capsys.readouterr().out


def test_cuda_graphs_train_like_eager(capsys):
    eager, _ = train(False, capsys)
    graphed, out = train({"mode": "reduce-overhead"}, capsys)
    assert "without CUDA graphs" not in out  # the conditions hold: no fallback
    assert graphed == pytest.approx(eager, rel=1e-4)
