"""run.loader follows the run's epoch and cursor wherever it is built; drop_last drops batches."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain
from paratrain.data import ShardedSampler
from paratrain.data.batched import build_loader
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification

CPU = torch.device("cpu")
SAMPLES, BATCH, EPOCHS = 80, 5, 3  # 16 steps per epoch


def train(directory, *, built, stop_at=None, batched=True):
    """Train EPOCHS epochs (or stop after step ``stop_at``, saved); return what it saw.

    ``built``: "before" (one loader before run.epochs), "inside" (a new loader over the
    same dataset every epoch) or "new-dataset" (a new loader over a new dataset object).
    """
    data = synthetic_classification(SAMPLES, num_features=4)
    with paratrain.Run(accelerator="cpu", progress=False, seed=5,
                       checkpoint_dir=str(directory)) as run:
        model = nn.Linear(4, 3)
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = run.loader(data, batch_size=BATCH, batched=batched) if built == "before" else None
        first, losses = [], []
        for epoch in run.epochs(EPOCHS):
            if built != "before":
                dataset = data if built == "inside" else synthetic_classification(
                    SAMPLES, num_features=4)
                loader = run.loader(dataset, batch_size=BATCH, batched=batched)
            for index, (x, y) in enumerate(loader):
                if index == 0:
                    first.append((epoch, x.clone()))
                loss = F.cross_entropy(model(x), y)
                run.backward(loss)
                run.step(optimizer)
                losses.append(float(loss.detach()).hex())
                if run.global_step == stop_at:
                    run.save()
                    return run.global_step, first, losses, model.weight.detach().clone()
            run.save()
        return run.global_step, first, losses, model.weight.detach().clone()


@pytest.mark.parametrize("built", ["inside", "new-dataset"])
def test_a_loader_built_inside_the_epoch_loop_reshuffles_like_one_built_before(tmp_path, built):
    before = train(tmp_path / "before", built="before")
    inside = train(tmp_path / built, built=built)
    assert [e for e, _ in inside[1]] == [0, 1, 2]
    # A new shuffle every epoch, and the same one as a loader built before the loop.
    assert not torch.equal(inside[1][0][1], inside[1][1][1])
    assert not torch.equal(inside[1][1][1], inside[1][2][1])
    assert all(torch.equal(a[1], b[1]) for a, b in zip(before[1], inside[1]))
    assert inside[0] == before[0] == EPOCHS * SAMPLES // BATCH
    assert inside[2] == before[2]


@pytest.mark.parametrize("built", ["before", "inside", "new-dataset"])
@pytest.mark.parametrize("stop_at", [32, 20])  # at an epoch's end, in the middle of one
def test_resume_with_a_loader_built_inside_the_loop_is_exact(tmp_path, built, stop_at):
    steps, _, _, weight = train(tmp_path / "whole", built="before")
    stopped = train(tmp_path / "cut", built=built, stop_at=stop_at)
    assert stopped[0] == stop_at
    resumed = train(tmp_path / "cut", built=built)
    assert resumed[0] == steps == EPOCHS * SAMPLES // BATCH  # no epoch trained twice
    assert stopped[2] + resumed[2] == train(tmp_path / "again", built="before")[2]
    assert torch.equal(resumed[3], weight)


def test_a_replaced_loader_iterated_again_is_refused_in_one_line():
    with paratrain.Run(accelerator="cpu", progress=False, seed=5) as run:
        first = None
        for epoch in run.epochs(2):
            # Built in epoch 0 only, another (per-epoch) loader over other data beside it:
            # the run cannot keep the first one following the epochs.
            if first is None:
                first = run.loader(synthetic_classification(8), batch_size=4)
            run.loader(synthetic_classification(12), batch_size=4)
            if epoch == 1:
                with pytest.raises(RuntimeError) as info:
                    next(iter(first))
                assert "\n" not in str(info.value)
                assert "replaced by a run.loader() built in epoch 1" in str(info.value)
            else:
                list(first)


# -- drop_last ---------------------------------------------------------------------------
def rank_batches(n, world, batch, **kw):
    out = []
    for rank in range(world):
        sampler = ShardedSampler(n, num_replicas=world, rank=rank, seed=3, batch_size=batch,
                                 **kw)
        for batched in (True, False):
            loader = build_loader(synthetic_classification(n), sampler, batch_size=batch,
                                  device=CPU, num_workers=0, pin_memory=False,
                                  persistent_workers=False, collate_fn=None, batched=batched,
                                  device_resident=False)
            out.append([len(x) for x, _ in loader])
    return out


def test_drop_last_drops_the_partial_batch_on_every_rank():
    # 130 samples, 2 ranks, 32 per rank: two whole global batches of 64; 2 samples dropped.
    assert rank_batches(130, 2, 32, drop_last=True) == [[32, 32]] * 4
    # The default keeps (and pads) the tail, exactly as before.
    assert rank_batches(130, 2, 32) == [[32, 32, 1]] * 4


def test_drop_last_keeps_resume_and_offsets_in_whole_global_batches():
    sampler = ShardedSampler(130, num_replicas=2, rank=1, seed=3, batch_size=32, drop_last=True)
    assert sampler.total_size == 128 and len(sampler) == 64
    sampler.set_epoch(1, 64)
    assert len(sampler) == 32 and len(list(sampler)) == 32


def test_drop_last_default_order_is_unchanged_by_the_batch_size():
    a = ShardedSampler(130, num_replicas=2, rank=0, seed=3)
    b = ShardedSampler(130, num_replicas=2, rank=0, seed=3, batch_size=32)
    assert list(a) == list(b) and a.total_size == b.total_size == 130


def test_drop_last_with_fewer_samples_than_one_global_batch_is_one_line():
    with paratrain.Run(accelerator="cpu", progress=False) as run:
        with pytest.raises(ValueError) as info:
            run.loader(synthetic_classification(20), batch_size=32, drop_last=True)
    message = str(info.value)
    assert "\n" not in message and "drop_last" in message and "20 samples" in message


def batchnorm_worker(rank, world_size):
    with paratrain.Run(strategy="ddp", accelerator="cpu", progress=False, seed=2) as run:
        model = nn.Sequential(nn.Linear(10, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = run.loader(synthetic_classification(130), batch_size=32, drop_last=True)
        sizes = []
        for _ in run.epochs(2):
            for x, y in loader:
                sizes.append(len(x))
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
        return sizes, run.global_step, run.epoch_stats[-1]["samples"]


def test_drop_last_with_batchnorm_on_two_ranks_never_sees_a_batch_of_one():
    for sizes, steps, samples in spawn(batchnorm_worker, 2):
        assert sizes == [32] * 4 and steps == 4 and samples == 128
