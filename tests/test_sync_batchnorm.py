"""Run(sync_batchnorm=True): BatchNorm over the global batch matches one process (gloo)."""

import pytest
import torch
from torch import nn

import paratrain
from paratrain.sync_batchnorm import GroupBatchNorm
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification, train_steps


def bn_model():
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(10, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3))


def train(strategy, sync, batch_size):
    run = paratrain.Run(strategy=strategy, sync_batchnorm=sync, progress=False, seed=2)
    model = bn_model()
    # SGD: a parameter differs from one process by lr x the gradient's rounding, so
    # equality to 1e-5 is an arithmetic bound, not a machine's (Adam would divide the
    # rounding by sqrt(v) of tiny gradients).
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = run.prepare(model, optimizer)
    loader = run.loader(synthetic_classification(64), batch_size=batch_size)
    losses = train_steps(run, model, optimizer, loader, num_steps=4)
    state = {k: v.detach().clone() for k, v in run.strategy.unwrap(model).state_dict().items()}
    kinds = sorted({type(m).__name__ for m in run.strategy.unwrap(model).modules()})
    run.close()
    return losses, state, kinds


def worker(rank, world_size, sync):
    return train("ddp", sync, 8)


def _max_difference(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.slow
def test_sync_batchnorm_matches_one_process_and_plain_batchnorm_does_not():
    ref_losses, ref_state, _ = train("single", True, 16)  # one process: nothing to convert
    synced = spawn(worker, 2, True, timeout=180)
    plain = spawn(worker, 2, False, timeout=180)
    for losses, state, kinds in synced:
        assert "GroupBatchNorm" in kinds
        # Float32 sums over 16 samples taken in another order: a few ulps of values O(1).
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert _max_difference(state, ref_state) < 1e-5
    # Without it each rank normalises by its own 8 samples: far more than rounding.
    assert _max_difference(plain[0][1], ref_state) > 1e-3


def test_group_batchnorm_keeps_the_state_and_falls_back_in_eval():
    source = nn.BatchNorm2d(4, momentum=None)
    source.running_mean.fill_(0.5)
    layer = GroupBatchNorm(source, group=None)
    assert set(layer.state_dict()) == set(source.state_dict())
    assert torch.equal(layer.running_mean, source.running_mean)
    layer.eval()
    x = torch.randn(2, 4, 3, 3)
    source.eval()
    assert torch.equal(layer(x), source(x))
    with pytest.raises(ValueError, match="expected at least 2-D input"):
        layer.train()(torch.randn(4))


def test_sync_batchnorm_is_validated():
    with pytest.raises(ValueError, match="sync_batchnorm must be True or False"):
        paratrain.RunConfig(sync_batchnorm="yes")


def test_conversion_keeps_the_parameters_the_optimizer_holds():
    model = bn_model()
    before = [id(p) for p in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    from paratrain.sync_batchnorm import convert_sync_batchnorm

    converted = convert_sync_batchnorm(model, group=None, group_size=2, device_type="cpu")
    assert isinstance(converted[1], GroupBatchNorm)
    assert [id(p) for p in converted.parameters()] == before
    assert {id(p) for p in optimizer.param_groups[0]["params"]} == set(before)


def test_group_batchnorm_gradients_are_as_exact_as_torch_batchnorm():
    # Its backward's per-channel sums cancel almost entirely: in float32 through autograd
    # they put 1% into a ResNet's first convolution's gradient (torch's kernel
    # accumulates in double). Held to the float64 gradients with the bound one
    # process's own float32 run meets.
    torchvision = pytest.importorskip("torchvision")
    import torch.distributed as dist
    import torch.nn.functional as F

    from paratrain.distributed.device import free_port
    from paratrain.sync_batchnorm import convert_sync_batchnorm
    from paratrain.testing.numerics import assert_gradients_within

    generator = torch.Generator().manual_seed(7)
    x, y = torch.randn(8, 3, 64, 64, generator=generator), torch.randint(4, (8,))

    def gradients(model, inputs):
        F.cross_entropy(model(inputs), y).backward()
        return {name: p.grad.double() for name, p in model.named_parameters()}

    def resnet():
        torch.manual_seed(0)
        return torchvision.models.resnet18(num_classes=4)

    exact = gradients(resnet().double(), x.double())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    try:
        # group_size 2 forces the conversion on this one-rank group.
        grouped = convert_sync_batchnorm(resnet(), group=None, group_size=2, device_type="cpu")
        assert isinstance(grouped.bn1, GroupBatchNorm)
        assert_gradients_within(gradients(grouped, x), exact)
    finally:
        dist.destroy_process_group()
