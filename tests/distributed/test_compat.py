"""The private torch APIs behind paratrain.distributed._compat work on the installed torch,
and a missing one degrades or fails with one line."""

import pytest
import torch
import torch.distributed as dist

from paratrain.distributed import _compat
from paratrain.distributed.device import free_port
from paratrain.testing.numerics import assert_gradients_within


def test_tree_map_and_tensor_subclass():
    assert _compat.tree_map(lambda x: x * 2, {"a": [1, (2, 3)]}) == {"a": [2, (4, 6)]}

    class Marker(torch.Tensor):
        pass

    marked = _compat.make_tensor_subclass(Marker, torch.zeros(()))
    assert type(marked) is Marker and marked.shape == ()
    with _compat.torch_function_disabled():
        # Without __torch_function__, results of ops are plain tensors.
        assert type(marked + 1) is torch.Tensor
    assert type(marked + 1) is Marker


def test_sequence_number_and_store_in_a_group():
    assert _compat.collective_sequence_number() == -1  # no group yet
    assert _compat.default_store() is None
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    try:
        before = _compat.collective_sequence_number()
        dist.all_reduce(torch.ones(1))
        after = _compat.collective_sequence_number()
        assert after > before >= 0
        store = _compat.default_store()
        store.set("k", "v")
        assert store.get("k") == b"v"
    finally:
        dist.destroy_process_group()


def test_ddp_reducer_is_released():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    try:
        # The keyword this torch version names for buffer syncing is accepted by DDP.
        ddp = torch.nn.parallel.DistributedDataParallel(
            torch.nn.Linear(2, 2), **_compat.ddp_buffer_sync_kwargs(False))
        _compat.release_ddp_reducer(ddp)
        assert ddp.reducer is None
    finally:
        dist.destroy_process_group()


def test_missing_private_api_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "_make_subclass", None)
    with pytest.raises(RuntimeError, match=r"lacks torch.Tensor._make_subclass.*>= 2.6"):
        _compat.make_tensor_subclass(torch.Tensor, torch.zeros(()))
    monkeypatch.delattr(dist.distributed_c10d, "_get_default_group")
    assert _compat.collective_sequence_number() == -1


def test_rebind_lr_scheduler_moves_the_schedule_and_its_order_check():
    import warnings

    old = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(old, step_size=1, gamma=0.1)
    new = torch.optim.SGD([dict(group) for group in old.param_groups])
    _compat.rebind_lr_scheduler(scheduler, new)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither "overridden" nor "before optimizer.step()"
        new.step()
        scheduler.step()
    assert new.param_groups[0]["lr"] == pytest.approx(0.1)
    assert old.param_groups[0]["lr"] == 1.0


def test_shard_indices_follow_dtensor_including_uneven_and_empty_pieces():
    from torch.distributed.tensor import Replicate, Shard

    # (shard, tensor) = (1, 0) of a 2 x 2 mesh: rows 2-3, columns 0-2 of a 4 x 6 tensor.
    rows, cols = _compat.shard_indices((4, 6), (2, 2), (1, 0), (Shard(0), Shard(1)))
    assert rows.tolist() == [2, 3] and cols.tolist() == [0, 1, 2]
    # Both mesh dimensions on 3 rows: torch.chunk's pieces 2 + 1, then 1 + 1 and 1 + 0.
    pieces = [_compat.shard_indices((3,), (2, 2), (s, t), (Shard(0), Shard(0)))[0].tolist()
              for s in range(2) for t in range(2)]
    assert pieces == [[0], [1], [2], []]
    assert _compat.shard_indices((3,), (2,), (1,), (Replicate(),))[0].tolist() == [0, 1, 2]


def test_all_gather_single_in_a_group_of_one():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    try:
        out = torch.empty(3)
        _compat.all_gather_single(out, torch.arange(3.0), dist.group.WORLD)
        assert out.tolist() == [0.0, 1.0, 2.0]
    finally:
        dist.destroy_process_group()


def _conv1d_worker(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers.pytorch_utils import Conv1D

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        torch.manual_seed(0)
        whole = torch.nn.Sequential(Conv1D(8, 4), torch.nn.GELU(), Conv1D(4, 8))
        split = torch.nn.Sequential(Conv1D(8, 4), torch.nn.GELU(), Conv1D(4, 8))
        split.load_state_dict(whole.state_dict())
        mesh = init_device_mesh("cpu", (world_size,))
        parallelize_module(split, mesh, {"0": _compat.transposed_linear_style("colwise"),
                                         "2": _compat.transposed_linear_style("rowwise")})
        x = torch.randn(3, 5, 4)
        whole(x).square().sum().backward()
        out = split(x)
        out.square().sum().backward()
        return {"out": (out.detach(), whole(x).detach()),
                "local": [tuple(p.to_local().shape) for p in split.parameters()],
                "grads": ({str(i): p.grad.full_tensor() for i, p in enumerate(split.parameters())},
                          {str(i): p.grad for i, p in enumerate(whole.parameters())})}
    finally:
        dist.destroy_process_group()


def test_transposed_linear_style_splits_conv1d_as_torch_splits_a_linear():
    pytest.importorskip("transformers")
    from paratrain.testing.pool import spawn

    for result in spawn(_conv1d_worker, 2, timeout=120):
        # (in, out) weights: colwise halves the columns and the bias, rowwise the rows
        # (its bias whole); forward and gradients equal the unsplit pair up to one
        # reassociated sum (the rowwise all-reduce).
        assert result["local"] == [(4, 4), (4,), (4, 4), (4,)]
        out, reference = result["out"]
        assert_gradients_within({"out": out}, {"out": reference})  # same bound: one sum
        assert_gradients_within(*result["grads"])


def test_schedule_actions_read_torchs_plan_without_a_process_group():
    plan = _compat.schedule_actions("ScheduleZBVZeroBubble", 2, 4, [0, 3])
    assert plan[0][0] == ("F", 0, 0) and {s for _, s, _ in plan[0]} == {0, 3}
    assert {k for acts in plan.values() for k, _, _ in acts} == {"F", "I", "W"}
    dual = _compat.schedule_actions("ScheduleDualPipeV", 2, 4, [0, 3])  # overlaps split
    assert sum(k == "F" for acts in dual.values() for k, _, _ in acts) == 4 * 4
    with pytest.raises(ValueError):  # torch's own refusal
        _compat.schedule_actions("ScheduleDualPipeV", 2, 3, [0, 3])
    with pytest.raises(RuntimeError, match="lacks torch.distributed.pipelining.ScheduleNone"):
        _compat.schedule_actions("ScheduleNone", 2, 4, [0])
