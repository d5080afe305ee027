"""Process groups on CUDA: NCCL start and teardown, GPUs shared over gloo, torch.compile."""

import datetime
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import paratrain
from paratrain.distributed.process_group import destroy_process_group
from paratrain.distributed.spawn import WorkerFailed
from paratrain.distributed.topology import Topology
from paratrain.strategies.capabilities import local_module
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification, train_steps

pytestmark = pytest.mark.gpu


def nccl_worker(rank, world_size):
    topology = Topology.from_env(accelerator="cuda")
    torch.cuda.set_device(topology.device)
    # A one-process job needs no group in paratrain, so this one is made by hand.
    dist.init_process_group(topology.backend, rank=rank, world_size=world_size,
                            device_id=topology.device, timeout=datetime.timedelta(seconds=60))
    value = torch.full((3,), float(rank + 1), device=topology.device)
    dist.all_reduce(value)
    dist.barrier()
    torch.cuda.synchronize()
    backend = dist.get_backend()
    destroy_process_group()
    return topology.backend, backend, value.cpu(), dist.is_initialized()


def test_nccl_group_starts_reduces_and_tears_down():
    [(chosen, backend, value, still_up)] = spawn(nccl_worker, 1, accelerator="cuda", timeout=120)
    assert chosen == "nccl" and backend == "nccl"
    assert value.tolist() == [1.0, 1.0, 1.0]
    assert not still_up


def mlp():
    return nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 3))


def train(strategy, batch_size, *, compile_model=False, num_steps=4):
    run = paratrain.Run(strategy=strategy, accelerator="cuda", progress=False, seed=7)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if compile_model:
        model = torch.compile(model)
    model, optimizer = run.prepare(model, optimizer)
    loader = run.loader(synthetic_classification(96), batch_size=batch_size)
    losses = train_steps(run, model, optimizer, loader, num_steps=num_steps)
    params = {k.removeprefix("_orig_mod."): v.detach().cpu()
              for k, v in local_module(run.strategy, model).state_dict().items()}
    placement = (str(run.device), run.topology.backend, run.topology.shares_device)
    run.close()
    return params, losses, placement


def ddp_worker(rank, world_size):
    return train("ddp", 8)


def assert_matches(results, reference, atol=1e-5):
    ref_params, ref_losses, _ = reference
    for params, losses, _ in results:
        assert losses == pytest.approx(ref_losses, abs=atol)
        assert params.keys() == ref_params.keys()
        for name, value in params.items():
            torch.testing.assert_close(value, ref_params[name], atol=atol, rtol=1e-5)


@pytest.mark.slow
def test_ddp_on_two_gpus_over_nccl_matches_one_process():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    results = spawn(ddp_worker, 2, accelerator="cuda", timeout=240)
    assert [placement for _, _, placement in results] == [
        ("cuda:0", "nccl", False), ("cuda:1", "nccl", False)]
    assert_matches(results, train("single", 16))


@pytest.mark.slow
def test_two_processes_share_one_gpu_over_gloo_when_asked():
    # One visible GPU for two ranks: refused by default, shared with PARATRAIN_SHARE_GPUS=1.
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or "0"
    one_gpu = {"CUDA_VISIBLE_DEVICES": first}
    with pytest.raises(WorkerFailed, match="only 1 CUDA device"):
        spawn(ddp_worker, 2, accelerator="cuda", env=one_gpu, timeout=120)
    results = spawn(ddp_worker, 2, accelerator="cuda", timeout=240,
                    env={**one_gpu, "PARATRAIN_SHARE_GPUS": "1"})
    assert [placement for _, _, placement in results] == [("cuda:0", "gloo", True)] * 2
    assert_matches(results, train("single", 16))


@pytest.mark.slow
def test_compiled_model_trains_through_prepare():
    eager = train("single", 16)
    compiled = train("single", 16, compile_model=True)
    # Fused kernels may round differently from eager ones; the training is the same.
    assert_matches([compiled], eager, atol=1e-4)
