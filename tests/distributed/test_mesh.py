"""Parallel degrees and mesh coordinates: pure logic, no process group."""

import pytest

from paratrain.distributed.mesh import ParallelDegrees, ParallelMesh, coordinates
from paratrain.distributed.topology import Topology


def test_infer_fills_the_missing_degree():
    d = ParallelDegrees.infer(world_size=8, pipeline_degree=2, shard_degree=2)
    assert d.shape == (2, 2, 2, 1, 1) and d.data_parallel_degree == 4
    assert ParallelDegrees.infer(world_size=6).replicate_degree == 6
    assert ParallelDegrees.infer(world_size=4, replicate_degree=2, shard_degree=None).shape == (
        1, 2, 2, 1, 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"pipeline_degree": 3}, "pipeline_degree=3 does not divide the world size 4"),
    ({"shard_degree": 0}, "shard_degree must be an integer >= 1, got 0"),
    ({"replicate_degree": 2, "shard_degree": 2, "pipeline_degree": 2},
     "= 8 but the world size is 4"),
])
def test_bad_degrees_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelDegrees.infer(world_size=4, **kwargs)


def test_validate_names_the_product():
    with pytest.raises(ValueError, match="pipeline_degree=2 x replicate_degree=1 x shard_degree=1"):
        ParallelDegrees(pipeline_degree=2).validate(4)


def test_coordinates_put_shards_innermost():
    d = ParallelDegrees(pipeline_degree=2, replicate_degree=2, shard_degree=2)
    assert [tuple(coordinates(r, d).values())[:3] for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    mesh = ParallelMesh(d, Topology(rank=5, world_size=8, local_world_size=2, local_rank=1,
                                    num_nodes=4, node_rank=2))
    assert (mesh.pipeline_rank, mesh.data_parallel_rank) == (1, 1)
    assert mesh.global_rank(pipeline=0) == 1 and mesh.global_rank(shard=0, replicate=1) == 6
    with pytest.raises(ValueError, match="= 8 but the world size is 6"):
        ParallelMesh(d, Topology(rank=0, world_size=6, local_world_size=1, num_nodes=6))


def test_tensor_axis_is_innermost_and_counts_in_the_product():
    d = ParallelDegrees.infer(world_size=8, shard_degree=2, tensor_degree=2)
    assert d.shape == (1, 2, 2, 1, 2) and d.data_parallel_degree == 4
    assert [coordinates(r, d)["tensor"] for r in range(4)] == [0, 1, 0, 1]
    assert [coordinates(r, d)["shard"] for r in range(4)] == [0, 0, 1, 1]
    mesh = ParallelMesh(d, Topology(rank=3, world_size=8, local_world_size=4, local_rank=3,
                                    num_nodes=2, node_rank=0))
    assert mesh.data_parallel_rank == 1 and mesh.global_rank(tensor=0) == 2
    with pytest.raises(ValueError, match="tensor_degree=3 does not divide the world size 4"):
        ParallelDegrees.infer(world_size=4, tensor_degree=3)
    with pytest.raises(ValueError, match="x tensor_degree=2 = 8 but the world size is 4"):
        ParallelDegrees(shard_degree=4, tensor_degree=2).validate(4)
