"""``whole``: FSDP over tensor-parallel pieces gathered in one all_gather, exactly and
without DTensor's "sequential all_gather operations" warning."""

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paratrain.distributed import dtensor
from paratrain.distributed.mesh import ParallelDegrees, ParallelMesh
from paratrain.distributed.topology import Topology
from paratrain.testing.pool import spawn

SEQUENTIAL = "sequential all_gather"


class Records(logging.Handler):
    """Keeps what DTensor's redistribution logs (where the warning comes from)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def gather_worker(rank, world_size):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from paratrain.strategies.dtensor_params import whole_model_state

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    topology = Topology(rank=rank, world_size=4, local_world_size=4, local_rank=rank,
                        num_nodes=1)
    mesh = ParallelMesh(ParallelDegrees.infer(world_size=4, shard_degree=2, tensor_degree=2),
                        topology)
    torch.manual_seed(0)
    # 10 rows: tensor pieces of 5 rows, FSDP shards of 3 and 2 (uneven on purpose).
    model = nn.Sequential(nn.Linear(6, 10), nn.Linear(10, 7))
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    parallelize_module(model, mesh.submesh("tensor"), {"0": ColwiseParallel(),
                                                         "1": RowwiseParallel()})
    fully_shard(model, mesh=mesh.submesh("shard"))
    state = model.state_dict()
    records = Records()
    logging.getLogger("torch.distributed.tensor._redistribute").addHandler(records)
    gathers = []
    one_collective = dtensor.all_gather_single

    def counted(output, piece, group):
        gathers.append(group)
        return one_collective(output, piece, group)

    dtensor.all_gather_single = counted
    got = {k: dtensor.whole(v) for k, v in state.items()}
    dtensor.all_gather_single = one_collective
    from_module = whole_model_state(model)
    quiet = list(records.messages)
    # DTensor's own gather of the same weight: the warning the check above looks for.
    state["0.weight"].full_tensor()
    result = {"placements": {k: len([p for p in v.placements if not p.is_replicate()])
                             for k, v in state.items()},
              "equal": all(torch.equal(got[k], v) and torch.equal(from_module[k], v)
                           for k, v in expected.items()),
              "gathers": [dist.get_world_size(group) for group in gathers],
              "quiet": quiet, "loud": records.messages[len(quiet):]}
    dist.destroy_process_group()
    return result


@pytest.mark.slow
def test_fsdp_over_tp_pieces_are_gathered_whole_in_one_step_without_warning():
    results = spawn(gather_worker, 4, timeout=120)
    for result in results:
        # Both weights and the colwise bias are sharded over shard and tensor.
        assert [result["placements"][k] for k in ("0.weight", "0.bias", "1.weight")] == [2, 2, 2]
        assert result["equal"]
        # One all_gather over the 4 ranks for each tensor sharded two ways.
        assert not [m for m in result["quiet"] if SEQUENTIAL in m]
        assert result["gathers"] == [4, 4, 4]
    assert any(SEQUENTIAL in m for r in results for m in r["loud"])


def test_whole_leaves_plain_values_alone():
    value = torch.arange(3.0)
    assert dtensor.whole(value) is value and dtensor.whole(2.5) == 2.5
