"""The default step reads no tensor value on the host where such a read waits for the
device (CUDA); ``tests/gpu/test_gpu_compile.py`` checks the same with CUDA's sync
detector. On the CPU the non-finite guard's read is free, and ``nan="stop"`` uses it to
stop before the update; the tests here make the guard treat reads as a GPU's."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain


def forbid_host_reads(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError("a tensor was read on the host inside the step")

    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)


@pytest.mark.parametrize("config", [{}, {"max_grad_norm": 0.5}, {"accumulate": 2}])
def test_step_reads_no_tensor_on_the_host(monkeypatch, config):
    run = paratrain.Run(accelerator="cpu", seed=1, **config)
    run._finite.host_reads_free = False  # as on a GPU: nan="stop" reads a step late
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model, optimizer = run.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, 4, generator=g), torch.randint(0, 2, (4,), generator=g))
            for _ in range(5)]
    before = [p.detach().clone() for p in model.parameters()]
    with monkeypatch.context() as patch:
        forbid_host_reads(patch)
        for x, y in run.progress(data):
            run.backward(F.cross_entropy(model(x), y))
            run.step(optimizer)
    assert run.global_step == 5 // config.get("accumulate", 1)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    if "max_grad_norm" in config:
        assert run.last_grad_norm > 0
    run.close()


def test_stop_on_a_gpu_reads_a_step_late_and_says_the_update_was_applied(monkeypatch):
    run = paratrain.Run(accelerator="cpu", seed=1, progress=False)
    run._finite.host_reads_free = False  # as on a GPU
    model = nn.Linear(4, 2)
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
    run.backward(F.cross_entropy(model(x), y) * float("nan"))
    run.step(optimizer)  # decided one step late: no read, the update is applied
    with pytest.raises(paratrain.run.finite.NonFiniteError,
                       match="stopped before the next update; that step's was applied"):
        run.backward(F.cross_entropy(model(x), y))
        run.step(optimizer)
    run.close()
