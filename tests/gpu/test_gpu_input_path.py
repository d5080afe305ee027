"""The batched input path on CUDA: streamed from pinned memory or resident, same batches."""

import pytest
import torch
from torch.utils.data import TensorDataset

from paratrain.data import BatchedLoader, DistributedLoader, ShardedSampler, batched_source

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


def loaders(dataset, *, device_resident):
    def sampler():
        return ShardedSampler(len(dataset), num_replicas=2, rank=1, seed=2)
    old = DistributedLoader(dataset, sampler(), batch_size=5, device=CUDA, num_workers=0,
                            pin_memory=True, persistent_workers=False)
    new = BatchedLoader(dataset, sampler(), source=batched_source(dataset), batch_size=5,
                        device=CUDA, pin_memory=True, device_resident=device_resident)
    return old, new


@pytest.mark.parametrize("device_resident", [False, True])
def test_cuda_batches_equal_the_dataloader_path(device_resident):
    g = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(37, 3, 4, generator=g), torch.randint(0, 5, (37,)))
    old, new = loaders(dataset, device_resident=device_resident)
    assert (new.source.device.type == "cuda") == device_resident
    for epoch, offset in [(0, 0), (1, 12)]:
        old.set_epoch(epoch, offset)
        new.set_epoch(epoch, offset)
        count = 0
        for a, b in zip(old, new, strict=True):
            # Work queued on the compute stream right away must see the copied batch.
            total = b[0].sum() + 0
            for x, y in zip(a, b):
                assert y.device.type == "cuda" and x.dtype == y.dtype and torch.equal(x, y)
            assert torch.equal(total, a[0].sum())
            count += 1
        assert count > 0 and old.cursor == new.cursor
