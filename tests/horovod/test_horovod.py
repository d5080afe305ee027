"""paratrain.horovod: Horovod's API on 2 gloo ranks against a single-process reference."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paratrain.horovod as hvd
from paratrain.testing.numerics import TrainingBound, assert_params_within
from paratrain.testing.pool import spawn

MICRO_BATCH = 4  # per rank and backward pass
NUM_STEPS = 3


@pytest.fixture(autouse=True)
def reset_horovod():
    hvd.shutdown()
    yield
    hvd.shutdown()


def data(num_samples):
    g = torch.Generator().manual_seed(3)
    return torch.randn(num_samples, 6, generator=g), torch.randint(0, 3, (num_samples,), generator=g)


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def reference(passes, world_size):
    """One process: each pass's loss is the mean over the global micro-batch of all ranks."""
    model, optimizer = model_and_optimizer()
    bound = TrainingBound(model, optimizer)
    x, y = data(NUM_STEPS * passes * MICRO_BATCH * world_size)
    global_micro = MICRO_BATCH * world_size
    for step in range(NUM_STEPS):
        optimizer.zero_grad()
        for p in range(passes):
            start = (step * passes + p) * global_micro
            F.cross_entropy(model(x[start:start + global_micro]), y[start:start + global_micro]).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, bound


def train(rank, world_size, passes, compression, predivide):
    model, optimizer = model_and_optimizer()
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=model.named_parameters(), backward_passes_per_step=passes,
        compression=getattr(hvd.Compression, compression), gradient_predivide_factor=predivide)
    x, y = data(NUM_STEPS * passes * MICRO_BATCH * world_size)
    for step in range(NUM_STEPS):
        optimizer.zero_grad()
        for p in range(passes):
            start = ((step * passes + p) * world_size + rank) * MICRO_BATCH
            F.cross_entropy(model(x[start:start + MICRO_BATCH]), y[start:start + MICRO_BATCH]).backward()
        optimizer.step()
    too_many = None
    try:  # one backward pass more than promised must be refused
        for _ in range(passes + 1):
            F.cross_entropy(model(x[:MICRO_BATCH]), y[:MICRO_BATCH]).backward()
    except AssertionError as exc:
        too_many = str(exc)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return params, isinstance(optimizer, torch.optim.SGD), too_many


def worker(rank, world_size, configs):
    hvd.init()
    trained = [train(rank, world_size, 2, compression, predivide) for compression, predivide, _ in configs]
    return trained, collectives(rank)


# (compression, gradient_predivide_factor, tolerance against the float32 reference).
# None: float32 sums in another order, bounded by paratrain.testing.numerics. fp16: each
# gradient rounded to half precision (2 roundings of u = 2**-11 of gradients < 1) and
# carried through momentum SGD, lr 0.1 x (1 + 1.9 + 2.71) x 2u < 6e-4; 2e-3 is ~3x that.
CONFIGS = [("none", 1.0, None), ("fp16", 2.0, 2e-3)]


@pytest.fixture(scope="module")
def two_ranks():
    """Both 2-rank checks share one spawn: (training results, collective results) by rank."""
    return spawn(worker, 2, CONFIGS)


@pytest.mark.slow
def test_backward_passes_per_step_2_matches_single_process(two_ranks):
    expected, bound = reference(passes=2, world_size=2)
    results = [trained for trained, _ in two_ranks]
    for index, (_, _, atol) in enumerate(CONFIGS):
        for params, is_sgd, too_many in (by_rank[index] for by_rank in results):
            assert is_sgd
            assert too_many is not None and "backward_passes_per_step=2" in too_many
            if atol is None:
                assert set(params) == set(expected)
                assert_params_within(params, expected, bound)
            for name, ref in expected.items() if atol is not None else ():
                torch.testing.assert_close(params[name], ref, atol=atol, rtol=0)
        for name in expected:  # replicas stay bitwise identical
            assert torch.equal(results[0][index][0][name], results[1][index][0][name])


def collectives(rank):
    torch.manual_seed(rank)  # different weights on each rank until broadcast
    model = nn.Linear(4, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01 * (rank + 1))
    if rank == 0:
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()  # rank 0 alone has Adam state, as after a resume on rank 0
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    value = torch.tensor([float(rank + 1), 10.0 * rank])
    return {
        "identity": (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()),
        "weight": model.weight.detach().clone(),
        "lr": optimizer.param_groups[0]["lr"],
        "adam_steps": [float(s["step"]) for s in optimizer.state.values()],
        "average": hvd.allreduce(value),
        "sum": hvd.allreduce(value, op=hvd.Sum),
        "max": hvd.allreduce(value, op=hvd.Max),
        "fp16": hvd.allreduce(value, compression=hvd.Compression.fp16),
        "gathered": hvd.allgather(torch.arange(rank + 1)),
        "object": hvd.broadcast_object({"epoch": 7} if rank == 0 else None, root_rank=0),
    }


@pytest.mark.slow
def test_broadcasts_and_collectives(two_ranks):
    results = [out for _, out in two_ranks]
    for rank, out in enumerate(results):
        assert out["identity"] == (rank, 2, rank, 2)
        assert torch.equal(out["weight"], results[0]["weight"])
        assert out["lr"] == 0.01 and out["adam_steps"] == [1.0, 1.0]
        assert out["average"].tolist() == [1.5, 5.0]
        assert out["sum"].tolist() == [3.0, 10.0]
        assert out["max"].tolist() == [2.0, 10.0]
        assert out["fp16"].dtype == torch.float32 and out["fp16"].tolist() == [1.5, 5.0]
        assert out["gathered"].tolist() == [0, 0, 1]
        assert out["object"] == {"epoch": 7}


def test_single_process_is_a_job_of_one():
    hvd.init()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (0, 1, 0, 1)
    model, optimizer = model_and_optimizer()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    model(torch.ones(2, 6)).sum().backward()
    expected = [p - 0.1 * p.grad for p in model.parameters()]
    optimizer.step()
    for p, e in zip(model.parameters(), expected):
        torch.testing.assert_close(p.detach(), e.detach())
    assert hvd.allreduce(torch.tensor([2.0])).item() == 2.0


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="call hvd.init"):
        hvd.rank()
    hvd.init()
    model, optimizer = model_and_optimizer()
    with pytest.raises(ValueError, match="backward_passes_per_step must be >= 1"):
        hvd.DistributedOptimizer(optimizer, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="Adasum is not supported"):
        hvd.DistributedOptimizer(optimizer, op="adasum")
    with pytest.raises(ValueError, match="does not name every parameter"):
        hvd.DistributedOptimizer(optimizer, named_parameters=list(model.named_parameters())[:1])
    with pytest.raises(ValueError, match="not supported"):
        hvd.init(comm=[0, 1])
