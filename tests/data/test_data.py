import pytest
import torch

from paratrain.data.loader import ShardedSampler, epoch_order


def shards(n, world, *, batch=None, epoch=0, offset=0, **kw):
    out = []
    for rank in range(world):
        sampler = ShardedSampler(n, num_replicas=world, rank=rank, seed=3, **kw)
        sampler.set_epoch(epoch, offset)
        out.append(list(sampler))
        assert len(sampler) == len(out[-1])
    return out


@pytest.mark.parametrize("n, world", [(10, 2), (11, 2), (13, 4), (7, 3), (5, 5)])
def test_shards_cover_every_sample_once_and_pad_evenly(n, world):
    parts = shards(n, world)
    assert len({len(p) for p in parts}) == 1
    flat = [i for p in parts for i in p]
    assert set(flat) == set(range(n))
    assert len(flat) - n == (-n) % world  # only the padding repeats


@pytest.mark.parametrize("n, world", [(11, 2), (13, 4), (3, 4)])
def test_eval_shards_have_no_duplicates(n, world):
    parts = shards(n, world, pad=False)
    flat = sorted(i for p in parts for i in p)
    assert flat == list(range(n))


def test_drop_last_truncates_to_a_multiple():
    parts = shards(11, 4, drop_last=True)
    assert all(len(p) == 2 for p in parts)
    assert len({i for p in parts for i in p}) == 8


def test_each_epoch_is_reshuffled_identically_on_all_ranks():
    a = epoch_order(100, seed=3, epoch=0, shuffle=True)
    b = epoch_order(100, seed=3, epoch=1, shuffle=True)
    assert not torch.equal(a, b)
    assert torch.equal(a, epoch_order(100, seed=3, epoch=0, shuffle=True))
    assert shards(20, 2, epoch=1) != shards(20, 2, epoch=0)


def test_global_batches_do_not_depend_on_world_size():
    n, per_rank = 48, 3
    single = shards(n, 1)[0]
    for world in (2, 4):
        parts = shards(n, world)
        for k in range(n // (per_rank * world)):
            batch = {i for p in parts for i in p[k * per_rank:(k + 1) * per_rank]}
            assert batch == set(single[k * per_rank * world:(k + 1) * per_rank * world])


@pytest.mark.parametrize("world_before, world_after", [(2, 2), (2, 1), (1, 2), (2, 4)])
def test_resume_from_offset_continues_without_duplicates(world_before, world_after):
    n, offset = 40, 12
    seen = set(shards(n, 1)[0][:offset])
    rest = [i for p in shards(n, world_after, offset=offset) for i in p]
    assert seen.isdisjoint(rest)
    assert seen | set(rest) == set(range(n))


def test_too_small_dataset_is_a_clear_error():
    with pytest.raises(ValueError, match="dataset has 2 samples but there are 4"):
        ShardedSampler(2, num_replicas=4, rank=0)


def test_invalid_rank():
    with pytest.raises(ValueError, match="rank must be in"):
        ShardedSampler(10, num_replicas=2, rank=2)
