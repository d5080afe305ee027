"""The batched input path gives the DataLoader path's batches, element for element."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, Subset, TensorDataset

import paratrain
from paratrain.data import BatchedLoader, DistributedLoader, ShardedSampler, batched_source
from paratrain.data.batched import build_loader

CPU = torch.device("cpu")


def tensor_dataset(n=23):
    g = torch.Generator().manual_seed(5)
    return TensorDataset(torch.randn(n, 1, 3, 3, generator=g), torch.randint(0, 9, (n,), generator=g),
                         torch.randint(0, 255, (n, 2), generator=g).to(torch.uint8),
                         torch.randn(n, generator=g).double() > 0,
                         torch.randn(n, 2, generator=g).bfloat16())


class DictItems(Dataset):
    """A dataset with torch's batched-fetch protocol, returning dict samples."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        x, y, *_ = self.base[i]
        return {"x": x * 2, "y": y}

    def __getitems__(self, indices):
        return [self[i] for i in indices]


class Augmented(TensorDataset):
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return x.flip(-1), y


def loader_pair(dataset, world, rank, *, batch=4, drop_last_batch=False, **sampler_kw):
    def sampler():
        return ShardedSampler(len(dataset), num_replicas=world, rank=rank, seed=11, **sampler_kw)
    old = DistributedLoader(dataset, sampler(), batch_size=batch, device=CPU, num_workers=0,
                            pin_memory=False, persistent_workers=False,
                            drop_last_batch=drop_last_batch)
    new = BatchedLoader(dataset, sampler(), source=batched_source(dataset), batch_size=batch,
                        device=CPU, pin_memory=False, drop_last_batch=drop_last_batch)
    return old, new


def assert_same_batch(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_batch(a[key], b[key])
    else:
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_batch(x, y)


def assert_same_epoch(old, new, *, epoch=0, offset=0):
    for loader in (old, new):
        loader.set_epoch(epoch, offset)
    expected = len(old)
    assert len(new) == expected
    pairs = list(zip(old, new, strict=True))
    if offset < old.sampler.total_size:  # else the loaders restart the epoch
        assert len(pairs) == expected
    for a, b in pairs:
        assert_same_batch(a, b)
    assert (old.cursor, old.batches_in_epoch) == (new.cursor, new.batches_in_epoch)
    return len(pairs)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("tail", [{}, {"drop_last": True}, {"pad": False}])
def test_batches_equal_the_dataloader_path(world, shuffle, tail):
    dataset = tensor_dataset()
    for rank in range(world):
        old, new = loader_pair(dataset, world, rank, shuffle=shuffle, **tail)
        assert_same_epoch(old, new, epoch=1)
        assert_same_epoch(old, new, epoch=2, offset=7)


def test_drop_last_batch_and_getitems_datasets_match():
    dataset = tensor_dataset()
    for rank in range(2):
        # 12 samples per rank in batches of 5: the partial batch of 2 is what is dropped.
        assert assert_same_epoch(*loader_pair(dataset, 2, rank, batch=5)) == 3
        assert assert_same_epoch(*loader_pair(dataset, 2, rank, batch=5,
                                               drop_last_batch=True)) == 2
        assert_same_epoch(*loader_pair(DictItems(dataset), 2, rank))
        assert_same_epoch(*loader_pair(Subset(dataset, list(range(3, 20))), 2, rank))


def test_resume_mid_epoch_continues_identically():
    dataset = tensor_dataset(41)
    old, new = loader_pair(dataset, 2, 1, batch=3)
    for loader in (old, new):
        loader.set_epoch(4)
        for step, _ in enumerate(loader):
            if step == 2:
                break
    assert old.cursor == new.cursor and old.position == new.position == 3 * 3 * 2
    resumed_old, resumed_new = loader_pair(dataset, 2, 1, batch=3)
    assert_same_epoch(resumed_old, resumed_new, epoch=4, offset=new.cursor.offset)
    # An exhausted loader iterated again starts the epoch over, as the old one does.
    assert assert_same_epoch(resumed_old, resumed_new, epoch=4, offset=10**6) == 7


@pytest.mark.parametrize("case", ["transform", "workers", "collate", "off", "strided"])
def test_per_sample_datasets_and_explicit_options_keep_the_dataloader(case):
    x, y = torch.randn(8, 3), torch.arange(8)
    dataset = {"transform": Augmented(x, y), "strided": TensorDataset(x.t().contiguous().t(), y)}
    options = {"num_workers": 2 if case == "workers" else 0, "batched": case != "off",
               "collate_fn": (lambda items: items) if case == "collate" else None}
    sampler = ShardedSampler(8, num_replicas=1, rank=0)
    loader = build_loader(dataset.get(case, TensorDataset(x, y)), sampler, batch_size=2,
                          device=CPU, pin_memory=False, persistent_workers=False,
                          device_resident=False, **options)
    assert type(loader) is DistributedLoader


def train(batched, *, dropout=0.2):
    losses = []
    with paratrain.Run(accelerator="cpu", progress=False, seed=4) as run:
        model = nn.Sequential(nn.Flatten(), nn.Linear(9, 16), nn.Dropout(dropout), nn.ReLU(),
                              nn.Linear(16, 9))
        model, optimizer = run.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
        loader = run.loader(tensor_dataset(30), batch_size=4, batched=batched)
        assert isinstance(loader, BatchedLoader) == batched
        for _ in run.epochs(2):
            for x, y, *_ in loader:
                loss = F.cross_entropy(model(x), y)
                run.backward(loss)
                run.step(optimizer)
                losses.append(float(loss.detach()).hex())
        result = run.evaluate(model, run.eval_loader(TensorDataset(*tensor_dataset(30).tensors[:2]),
                                                     batch_size=7, batched=batched))
    return losses, result


def test_run_losses_are_bitwise_those_of_the_dataloader_path():
    fast, slow = train(True), train(False)
    assert len(fast[0]) == 2 * 8
    assert fast == slow
