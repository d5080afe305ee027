"""Device memory, data movement and checkpoints on CUDA."""

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.data import batched as batched_module
from paratrain.data import loader as data_module
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification

pytestmark = pytest.mark.gpu


class Block(nn.Module):
    """Wide activations, few parameters: what activation checkpointing is for."""

    def __init__(self, width=1024):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def peak_training_memory(checkpoint_activations):
    run = paratrain.Run(strategy="single", accelerator="cuda", progress=False, seed=1,
                        checkpoint_activations=checkpoint_activations)
    model = run.prepare(nn.Sequential(*[Block() for _ in range(6)]))
    x = torch.randn(8192, 1024, device="cuda")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    # Through run.backward, as training does: it ends the first step's FLOP count (MFU).
    run.backward(model(x).square().mean())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - baseline
    run.close()
    del model, x, run
    gc.collect()
    torch.cuda.empty_cache()
    return peak


def test_activation_checkpointing_lowers_peak_memory():
    without = peak_training_memory(None)
    with_checkpointing = peak_training_memory(Block)
    # Six blocks keep ~6 x 288 MiB of activations without recomputation (the 192 MiB of
    # gradients are the same for both); with it, the block inputs and one block at a time:
    # 0.32x measured on the CPU (592 of 1872 MiB). The 0.72x first seen here was the
    # first step's FLOP counter (torch's module tracker, dropped in e7e7ac4; CPU test:
    # tests/run/test_activation_checkpointing.py).
    assert with_checkpointing < 0.6 * without, (with_checkpointing, without)


def test_loader_batches_are_pinned_and_moved_without_blocking(monkeypatch):
    seen = []
    original = data_module.move_to_device

    def spy(batch, device, *, non_blocking=False):
        seen.append((all(t.is_pinned() for t in batch), non_blocking, device))
        return original(batch, device, non_blocking=non_blocking)

    # Wherever the loaders look it up: one call per batch (tests/data/test_device_moves.py).
    monkeypatch.setattr(data_module, "move_to_device", spy)
    monkeypatch.setattr(batched_module, "move_to_device", spy)
    run = paratrain.Run(strategy="single", accelerator="cuda", progress=False)
    loader = run.loader(synthetic_classification(32), batch_size=8)
    batches = [batch for _ in run.epochs(1) for batch in loader]
    run.close()
    assert len(batches) == 4 and all(x.is_cuda and y.is_cuda for x, y in batches)
    assert seen == [(True, True, run.device)] * 4
    # Asked not to pin, the copy blocks (a non-blocking copy from pageable memory is not async).
    run = paratrain.Run(strategy="single", accelerator="cuda", progress=False)
    seen.clear()
    for _ in run.epochs(1):
        list(run.loader(TensorDataset(torch.ones(8, 2)), batch_size=8, pin_memory=False))
    run.close()
    assert seen == [(False, False, run.device)]


def mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


def prepared(run):
    model = mlp()
    return run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))


def take_steps(run, model, optimizer, num_steps):
    x, y = synthetic_classification(16 * num_steps).tensors
    for xb, yb in zip(x.to(run.device).split(16), y.to(run.device).split(16)):
        run.backward(F.cross_entropy(model(xb), yb))
        run.step(optimizer)


def cpu_resume_worker(rank, world_size, gpu_checkpoint, directory):
    """Loads a checkpoint written on CUDA where no GPU is visible, trains, saves."""
    assert not torch.cuda.is_available()
    run = paratrain.Run(strategy="single", accelerator="cpu", progress=False, seed=2)
    model, optimizer = prepared(run)
    run.load(gpu_checkpoint)
    loaded = {k: v.clone() for k, v in model.state_dict().items()}
    momentum = [optimizer.state[p]["momentum_buffer"].device.type for p in model.parameters()]
    take_steps(run, model, optimizer, 1)
    path = run.save(directory)
    after = {k: v.clone() for k, v in model.state_dict().items()}
    run.close()
    return loaded, momentum, path, after


@pytest.mark.slow
def test_checkpoint_written_on_gpu_loads_on_cpu_and_back(tmp_path):
    run = paratrain.Run(strategy="single", accelerator="cuda", progress=False, seed=2)
    model, optimizer = prepared(run)
    take_steps(run, model, optimizer, 2)
    on_gpu = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    gpu_path = run.save(tmp_path / "gpu")
    run.close()

    [(loaded, momentum, cpu_path, after)] = spawn(
        cpu_resume_worker, 1, gpu_path, str(tmp_path / "cpu"), accelerator="cpu")
    for name, value in on_gpu.items():
        assert torch.equal(loaded[name], value), name
    assert set(momentum) == {"cpu"}

    run = paratrain.Run(strategy="single", accelerator="cuda", progress=False, seed=2)
    model, optimizer = prepared(run)
    run.load(cpu_path)
    assert run.global_step == 3
    for name, value in model.state_dict().items():
        assert value.is_cuda and torch.equal(value.cpu(), after[name]), name
    assert all(optimizer.state[p]["momentum_buffer"].is_cuda for p in model.parameters())
    run.close()
