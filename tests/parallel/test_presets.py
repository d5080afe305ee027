"""Named strategies are presets of degrees: the mapping (pure) and the same losses (gloo)."""

import pytest
import torch

import paratrain
from paratrain.distributed.mesh import ParallelDegrees
from paratrain.distributed.spawn import spawn
from paratrain.parallel import Parallel, Pipeline, Sharding, TensorParallel
from paratrain.parallel.presets import choose, preset, resolve_strategy
from paratrain.testing.reference import synthetic_classification, train_steps

PRESETS = ["ddp", "zero1", "fsdp", "zero2", "tp", "fsdp_tp", "pipeline", "hybrid"]


@pytest.mark.parametrize("shape, expected", [
    ((1, 1, 1, 1), ("single", {})),
    ((1, 4, 1, 1), ("ddp", {})),
    ((1, 1, 4, 1), ("fsdp", {})),
    ((1, 2, 2, 1), ("hybrid", {"shard_degree": 2, "replicate_degree": 2})),
    ((1, 1, 1, 4), ("tp", {})),
    ((1, 1, 2, 2), ("fsdp_tp", {"tensor_degree": 2})),
    ((4, 1, 1, 1), ("pipeline", {})),
    ((2, 2, 1, 1), ("hybrid", {"pipeline_degree": 2, "shard_degree": 1,
                               "replicate_degree": 2, "tensor_degree": 1})),
    ((2, 1, 2, 2), ("hybrid", {"pipeline_degree": 2, "shard_degree": 2,
                               "replicate_degree": 1, "tensor_degree": 2})),
])
def test_each_layout_has_one_implementation(shape, expected):
    degrees = ParallelDegrees(pipeline_degree=shape[0], replicate_degree=shape[1],
                              shard_degree=shape[2], tensor_degree=shape[3])
    assert choose(degrees, Parallel()) == expected


def test_typed_options_reach_the_implementation():
    layout = Parallel(pp=2, dp_shard=2, sharding=Sharding(reshard_after_forward=False),
                      pipeline=Pipeline(schedule="gpipe"))
    name, options = resolve_strategy("auto", {}, layout, world_size=4, local_world_size=4)
    assert name == "hybrid"
    assert options["fsdp"] == {"reshard_after_forward": False}
    assert options["pipeline"] == {"schedule": "gpipe"}
    name, options = resolve_strategy(
        "auto", {}, Parallel(tp=-1, tensor=TensorParallel(loss_parallel=True)),
        world_size=2, local_world_size=2)
    assert (name, options) == ("tp", {"loss_parallel": True})


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_names_degrees_that_choose_it_or_its_variant(name):
    world = 4
    degrees = preset(name, {}, local_world_size=world).resolve(world_size=world)
    chosen, _ = choose(degrees, Parallel())
    # zero1/zero2 are ddp/fsdp with another optimizer/reshard policy; hybrid's default is
    # HSDP over nodes, which on one node of 4 is plain sharding.
    assert chosen == {"zero1": "ddp", "zero2": "fsdp", "hybrid": "fsdp"}.get(name, name)
    # The preset and its spelled-out degrees agree, so the preset keeps running.
    assert resolve_strategy(name, {}, _spelled(degrees), world_size=world,
                            local_world_size=world)[0] == name


def _spelled(degrees):
    pp, replicate, shard, tp = degrees.shape
    return Parallel(pp=pp, dp_replicate=replicate, dp_shard=shard, tp=tp)


@pytest.mark.parametrize("name, spec, message", [
    ("fsdp", "dp_replicate=4", r"strategy 'fsdp' means dp_shard=4 on 4 processes but "
                               r"parallel= says dp_replicate=4; drop one of them"),
    ("ps", "dp_shard=4", r"strategy 'ps' is not a layout of degrees"),
    ("auto", "dp_replicate=2,tp=2", r"dp_replicate x tp needs dp_shard > 1 \(HSDP x TP\)"),
    ("ddp", Parallel(dp_shard=4, sharding=Sharding(offload=True)), r"strategy 'ddp' means"),
])
def test_contradictions_are_one_line(name, spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_strategy(name, {}, spec, world_size=4, local_world_size=4)


def test_option_set_twice_is_refused():
    with pytest.raises(ValueError, match=r"option 'loss_parallel' is set both"):
        resolve_strategy("auto", {"loss_parallel": False},
                         Parallel(tp=2, tensor=TensorParallel(loss_parallel=True)),
                         world_size=2, local_world_size=2)


def _losses(strategy, parallel, world_size):
    run = paratrain.Run(strategy=strategy, parallel=parallel, progress=False, seed=5)
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = run.prepare(model, optimizer)
    loader = run.loader(synthetic_classification(64), batch_size=32 // run.strategy.data_parallel_size)
    losses = train_steps(run, model, optimizer, loader, num_steps=3)
    name = run.strategy.name
    run.close()
    return name, [float(x).hex() for x in losses]


def losses_worker(rank, world_size, strategy, parallel):
    return _losses(strategy, parallel, world_size)


@pytest.mark.slow
@pytest.mark.parametrize("name, spec", [("ddp", "dp_replicate=-1"), ("fsdp", "dp_shard=2"),
                                        ("pipeline", "pp=2")])
def test_presets_give_the_same_losses_as_their_degrees(name, spec):
    by_name = spawn(losses_worker, 2, name, None, timeout=240)
    by_degrees = spawn(losses_worker, 2, "auto", spec, timeout=240)
    assert [chosen for chosen, _ in by_degrees] == [name, name]
    assert by_name == by_degrees


def env_worker(rank, world_size):
    import os

    os.environ["PARATRAIN_PARALLEL"] = "dp_shard=-1"
    run = paratrain.Run(progress=False)
    name = run.strategy.name
    run.close()
    return name


def test_environment_sets_the_layout_for_scripts_that_do_not():
    assert spawn(env_worker, 2, timeout=120) == ["fsdp", "fsdp"]
