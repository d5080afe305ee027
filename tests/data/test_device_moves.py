"""Each loader batch reaches the device in one move: one ``move_to_device`` call per batch,
one ``Tensor.to`` per tensor (the CPU stand-in for the CUDA test in tests/gpu)."""

import pytest
import torch

import paratrain
from paratrain.data import batched as batched_module
from paratrain.data import loader as loader_module
from paratrain.testing.reference import synthetic_classification

BATCH, SAMPLES = 8, 32


@pytest.mark.parametrize("batched", [True, False])
def test_each_batch_is_moved_once_and_each_tensor_copied_once(monkeypatch, batched):
    moves, copies = [], []
    original_move, original_to = loader_module.move_to_device, torch.Tensor.to

    def spy(batch, device, *, non_blocking=False):
        moves.append(len(batch) if isinstance(batch, (list, tuple)) else type(batch).__name__)
        return original_move(batch, device, non_blocking=non_blocking)

    def counting_to(self, *args, **kwargs):
        if self.dim() and self.shape[0] == BATCH:  # a batch's tensor, not the sampler's order
            copies.append(tuple(self.shape))
        return original_to(self, *args, **kwargs)

    # The spy stands wherever the loaders look the function up.
    monkeypatch.setattr(loader_module, "move_to_device", spy)
    monkeypatch.setattr(batched_module, "move_to_device", spy)
    run = paratrain.Run(strategy="single", accelerator="cpu", progress=False)
    loader = run.loader(synthetic_classification(SAMPLES), batch_size=BATCH, batched=batched)
    monkeypatch.setattr(torch.Tensor, "to", counting_to)
    batches = [batch for _ in run.epochs(1) for batch in loader]
    monkeypatch.setattr(torch.Tensor, "to", original_to)
    run.close()
    assert len(batches) == SAMPLES // BATCH
    # One call per batch, holding the whole (x, y) batch; before, the spy also saw the
    # per-tensor calls of move_to_device's own recursion (x and y: "8 moves for 4 batches").
    assert moves == [2] * len(batches)
    # And no second move anywhere on the way to the step (Run, the strategy's local_batch).
    assert copies == [(BATCH, 10), (BATCH,)] * len(batches)


def test_move_to_device_keeps_the_nesting():
    Pair = __import__("collections").namedtuple("Pair", "a b")
    batch = {"x": [torch.ones(2), (torch.zeros(1),)], "p": Pair(torch.ones(1), 3)}
    moved = loader_module.move_to_device(batch, torch.device("cpu"))
    assert isinstance(moved["p"], Pair) and moved["p"].b == 3
    assert isinstance(moved["x"], list) and isinstance(moved["x"][1], tuple)
    assert torch.equal(moved["x"][0], torch.ones(2))
