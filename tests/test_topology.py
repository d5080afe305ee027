import pytest
import torch

from paratrain.topology import Topology


def test_unlaunched_is_single_process():
    topo = Topology.from_env({}, accelerator="cpu")
    assert (topo.rank, topo.world_size, topo.num_nodes, topo.source) == (0, 1, 1, "none")
    assert not topo.is_distributed and topo.is_main
    assert topo.device == torch.device("cpu") and topo.backend == "gloo"


def test_torchrun_variables():
    env = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
           "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2"}
    topo = Topology.from_env(env, accelerator="cpu")
    assert (topo.rank, topo.local_rank, topo.world_size, topo.local_world_size) == (5, 1, 8, 4)
    assert (topo.node_rank, topo.num_nodes, topo.source) == (1, 2, "torchrun")
    assert topo.is_distributed and not topo.is_main


def test_slurm_variables():
    env = {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_NTASKS": "4", "SLURM_NNODES": "2",
           "SLURM_NODEID": "1", "SLURM_NTASKS_PER_NODE": "2(x2)"}
    topo = Topology.from_env(env, accelerator="cpu")
    assert (topo.rank, topo.local_rank, topo.world_size, topo.local_world_size) == (3, 1, 4, 2)
    assert (topo.node_rank, topo.num_nodes, topo.source) == (1, 2, "slurm")


def test_openmpi_variables():
    env = {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
           "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    topo = Topology.from_env(env, accelerator="cpu")
    assert (topo.rank, topo.node_rank, topo.num_nodes, topo.source) == (2, 1, 2, "openmpi")


def test_torchrun_takes_precedence_over_slurm():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0",
           "SLURM_NTASKS": "1"}
    assert Topology.from_env(env, accelerator="cpu").source == "torchrun"


@pytest.mark.parametrize(
    "env, message",
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, "rank must be in"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "world_size must be >= 1"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "2"},
         "local_rank"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
    ],
)
def test_invalid_environment_is_named(env, message):
    with pytest.raises(ValueError, match=message):
        Topology.from_env(env, accelerator="cpu")


def test_cuda_requested_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(ValueError, match="no CUDA device"):
        Topology.from_env({}, accelerator="cuda")


def test_nccl_needs_cuda_device():
    with pytest.raises(ValueError, match="nccl"):
        Topology(backend="nccl")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_local_rank_selects_cuda_device():
    n = torch.cuda.device_count()
    env = {"RANK": str(n - 1), "WORLD_SIZE": str(n), "LOCAL_RANK": str(n - 1)}
    topo = Topology.from_env(env)
    assert topo.device == torch.device("cuda", n - 1) and topo.backend == "nccl"


def test_local_rank_beyond_gpus_is_rejected(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    env = {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "2"}
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        Topology.from_env(env)
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}
    topo = Topology.from_env(env)
    assert topo.device == torch.device("cuda", 1) and topo.backend == "nccl"
