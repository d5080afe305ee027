import pytest
import torch

from paratrain.distributed.topology import Topology


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


def fake_gpus(monkeypatch, count):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def two_local(rank):
    return {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": "2"}


def test_every_local_rank_refuses_more_processes_than_gpus(monkeypatch):
    fake_gpus(monkeypatch, 1)
    # Rank 0 would fit on cuda:0, but waiting for a rank that cannot start would hang.
    for rank in (0, 1):
        with pytest.raises(ValueError, match=r"LOCAL_RANK=\d of 2 processes on this node but "
                           r"only 1 CUDA device\(s\).*--share-gpus \(PARATRAIN_SHARE_GPUS=1\)"):
            Topology.from_env(two_local(rank))


@pytest.mark.parametrize("gpus, local_world, expected", [
    (1, 2, [0, 0]), (1, 3, [0, 0, 0]), (2, 3, [0, 1, 0]), (2, 5, [0, 1, 0, 1, 0])])
def test_shared_gpus_map_local_ranks_round_robin_over_gloo(monkeypatch, gpus, local_world,
                                                           expected):
    fake_gpus(monkeypatch, gpus)
    devices = []
    for rank in range(local_world):
        env = {"RANK": str(rank), "WORLD_SIZE": str(local_world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(local_world), "PARATRAIN_SHARE_GPUS": "1"}
        topo = Topology.from_env(env)
        assert topo.backend == "gloo" and topo.shares_device
        devices.append(topo.device)
    assert devices == [torch.device("cuda", i) for i in expected]
    assert "for testing multi-process code, not for speed" in topo.notice


def test_sharing_is_not_used_when_every_process_has_a_gpu(monkeypatch):
    fake_gpus(monkeypatch, 2)
    topo = Topology.from_env(two_local(1), share_gpus=True)
    assert (topo.device, topo.backend, topo.shares_device) == (torch.device("cuda", 1), "nccl",
                                                               False)
    assert topo.notice is None


def test_share_gpus_argument_overrides_the_environment(monkeypatch):
    fake_gpus(monkeypatch, 1)
    env = {**two_local(1), "PARATRAIN_SHARE_GPUS": "1"}
    with pytest.raises(ValueError, match="only 1 CUDA device"):
        Topology.from_env(env, share_gpus=False)
    assert Topology.from_env(two_local(1), share_gpus=True).device == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="PARATRAIN_SHARE_GPUS='maybe' must be 1 or 0"):
        Topology.from_env({"PARATRAIN_SHARE_GPUS": "maybe"})


def test_accelerator_environment_variable_replaces_auto_only(monkeypatch):
    fake_gpus(monkeypatch, 1)
    assert Topology.from_env({}).device == torch.device("cuda", 0)
    pinned = {**two_local(1), "PARATRAIN_ACCELERATOR": "cpu"}
    # Two processes on one GPU would be refused; pinned to the CPU they are fine.
    topo = Topology.from_env(pinned)
    assert (topo.device, topo.backend) == (torch.device("cpu"), "gloo")
    assert Topology.from_env({"PARATRAIN_ACCELERATOR": "cpu"}, accelerator="cuda").device == \
        torch.device("cuda", 0)
    with pytest.raises(ValueError, match="PARATRAIN_ACCELERATOR='tpu' must be one of"):
        Topology.from_env({"PARATRAIN_ACCELERATOR": "tpu"})


def test_shared_device_needs_cuda_and_gloo():
    with pytest.raises(ValueError, match="shares_device needs a CUDA device and backend 'gloo'"):
        Topology(shares_device=True)


def test_the_suite_pins_tests_to_the_cpu():
    import os

    from paratrain import Run

    assert os.environ["PARATRAIN_ACCELERATOR"] == "cpu"
    with Run(progress=False) as run:
        assert run.device == torch.device("cpu")


@pytest.mark.parametrize("rank", [0, 1])
def test_shared_gpus_start_gloo_with_a_notice_on_rank_zero(monkeypatch, capsys, rank):
    import torch.distributed as dist

    from paratrain.distributed import process_group as runtime

    calls = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: calls.append(("set", device)))
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: calls.append(("init", kw)))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    topo = Topology(rank=rank, local_rank=rank, world_size=2, local_world_size=2,
                    device=torch.device("cuda", 0), backend="gloo", shares_device=True)
    assert runtime.init_process_group(topo, timeout_s=5)
    assert calls[0] == ("set", torch.device("cuda", 0))
    # device_id would bind the group to one device, which is NCCL's business.
    assert calls[1][1]["backend"] == "gloo" and "device_id" not in calls[1][1]
    err = capsys.readouterr().err
    assert (err == "paratrain: GPUs are shared: 2 processes on 1 GPU(s) over gloo; this is for "
            "testing multi-process code, not for speed\n") == (rank == 0)
    assert rank == 0 or err == ""


def visibility_worker(rank, world_size):
    import os

    return os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("PARATRAIN_ACCELERATOR")


@pytest.mark.slow
def test_spawned_cpu_ranks_do_not_see_gpus(monkeypatch):
    import os

    from paratrain.testing.pool import spawn

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert spawn(visibility_worker, 1) == [("", "cpu")]
    assert spawn(visibility_worker, 1, accelerator="cuda") == [("0", "cuda")]
    # The parent's environment is as it was.
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0"
    assert os.environ["PARATRAIN_ACCELERATOR"] == "cpu"


def test_fault_tolerant_replica_groups_come_from_the_launchers_variable():
    assert Topology.from_env({}).replica_groups == 1
    env = {"RANK": "0", "WORLD_SIZE": "2", "PARATRAIN_REPLICA_GROUP": "1/3"}
    assert Topology.from_env(env, accelerator="cpu").replica_groups == 3
    with pytest.raises(ValueError, match="PARATRAIN_REPLICA_GROUP must be GROUP/GROUPS"):
        Topology.from_env({"PARATRAIN_REPLICA_GROUP": "3"}, accelerator="cpu")
