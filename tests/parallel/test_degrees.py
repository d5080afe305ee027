"""Parallel: parsing, -1 fill and one-line validation (pure logic, no processes)."""

import pytest

import paratrain
from paratrain.parallel import Parallel, Pipeline, Sharding, TensorParallel
from paratrain.parallel.degrees import describe


@pytest.mark.parametrize("spec", [
    "dp_shard=4,tp=2",
    {"dp_shard": 4, "tp": 2},
    Parallel(dp_shard=4, tp=2),
    " tp=2 , dp_shard=-1 ",
])
def test_the_three_spellings_resolve_alike(spec):
    degrees = Parallel.parse(spec).resolve(world_size=8)
    assert degrees.shape == (1, 1, 4, 1, 2)
    assert describe(degrees) == "dp_shard=4,tp=2"


def test_minus_one_fills_the_world_on_any_axis():
    assert Parallel(pp=2, dp_replicate=-1).resolve(world_size=8).shape == (2, 4, 1, 1, 1)
    assert Parallel(dp_shard=-1).resolve(world_size=1).shape == (1, 1, 1, 1, 1)
    assert paratrain.Parallel is Parallel


@pytest.mark.parametrize("spec, world, local, message", [
    ("dp_shard=3", 4, 4, r"Parallel.dp_shard=3 does not divide the world size 4"),
    ("dp_shard=2,tp=4", 4, 4, r"dp_shard=2 x cp=1 x tp=4 = 8 but the world size is 4"),
    ("dp_shard=2", 4, 4, r"dp_shard=2 x cp=1 x tp=1 = 2 but the world size is 4"),
    ("dp_shard=2,tp=2,ep=4", 4, 4, r"Parallel.ep=4 must divide dp_shard x cp = 2"),
    ("dp_replicate=2,tp=2,ep=2", 4, 4, r"Parallel.ep=2 must divide dp_shard x cp = 1"),
    ("dp_shard=-1,tp=3", 4, 4, r"tp=3 does not divide the world size 4"),
    ("pp=2,dp_shard=-1,tp=2", 6, 6, r"tp=2 does not divide the world size 6|cannot fill"),
    ("dp_replicate=2,tp=4", 8, 2, r"tp=4 does not fit in a node of 2 processes"),
])
def test_impossible_layouts_are_one_line_errors(spec, world, local, message):
    with pytest.raises(ValueError, match=message) as info:
        Parallel.parse(spec).resolve(world_size=world, local_world_size=local)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("spec, message", [
    ("dp_shard=x", r"dp_shard must be an integer, got 'x'"),
    ("shard=2", r"names: pp, dp_replicate, dp_shard, cp, tp, ep"),
    ("ep=0", r"Parallel.ep must be an integer >= 1"),
    ({"cp": 2, "context": "ring"}, r"Parallel.context must be a paratrain.ContextParallel"),
    ("tp=2,tp=2", r"tp is given twice"),
    ("", r"parallel is empty"),
    ("dp_shard=-1,tp=-1", r"only one degree may be -1"),
    ("tp=0", r"Parallel.tp must be an integer >= 1, or -1"),
    ({"dp_shards": 2}, r"unknown field\(s\) \['dp_shards'\]"),
    (4, r"parallel must be a paratrain.Parallel, a dict or a string"),
    ({"tp": True}, r"Parallel.tp must be an integer"),
])
def test_bad_specs_name_the_field(spec, message):
    with pytest.raises(ValueError, match=message):
        Parallel.parse(spec)


def test_typed_options_need_their_degree_and_are_checked_by_the_runtime():
    with pytest.raises(ValueError, match=r"Parallel.tensor options need tp > 1"):
        Parallel(dp_shard=2, tensor=TensorParallel(sequence_parallel=True))
    with pytest.raises(ValueError, match=r"Parallel.pipeline options need pp > 1"):
        Parallel(pipeline=Pipeline())
    with pytest.raises(ValueError, match=r"Parallel.sharding must be a paratrain.Sharding"):
        Parallel(dp_shard=2, sharding={"offload": True})
    with pytest.raises(ValueError, match=r"schedule must be one of"):
        Pipeline(schedule="zigzag")
    with pytest.raises(ValueError, match=r"TensorParallel.loss_parallel must be True or False"):
        TensorParallel(loss_parallel="yes")
    with pytest.raises(ValueError, match=r"Sharding.offload must be True or False"):
        Sharding(offload=1)
    with pytest.raises(ValueError, match=r"ContextParallel.method must be one of"):
        paratrain.ContextParallel(method="zigzag")
    with pytest.raises(ValueError, match=r"Parallel.context options need cp > 1"):
        Parallel(context=paratrain.ContextParallel())


def test_ep_borrows_the_data_ranks():
    assert Parallel.parse("ep=2").resolve(world_size=2).shape == (1, 1, 2, 1, 1)
    degrees = Parallel.parse("dp_shard=4,ep=2").resolve(world_size=4)
    assert (degrees.shard_degree, degrees.expert_degree, degrees.loss_degree) == (4, 2, 4)
    degrees = Parallel.parse("dp_shard=2,cp=2").resolve(world_size=4)
    assert (degrees.data_parallel_degree, degrees.loss_degree) == (2, 4)


def test_run_config_and_environment_validate_parallel():
    from paratrain.config import RunConfig
    from paratrain.settings import Settings

    with pytest.raises(ValueError, match=r"Parallel.tp must be an integer"):
        RunConfig(parallel={"tp": "2"})
    with pytest.raises(ValueError, match=r"PARATRAIN_PARALLEL='tp=two': parallel 'tp=two': "
                                         r"tp must be an integer"):
        Parallel.from_environment("tp=two")
    assert Settings.from_environ({"PARATRAIN_PARALLEL": "tp=2"}).parallel == "tp=2"
