"""Named strategies are presets of degrees: the mapping (pure) and the same losses (gloo)."""

import pytest
import torch

import paratrain
from paratrain.distributed.mesh import ParallelDegrees
from paratrain.parallel import Parallel, Pipeline, Sharding, TensorParallel
from paratrain.parallel.presets import choose, layout_name, preset, resolve_strategy
from paratrain.testing.pool import spawn
from paratrain.testing.reference import synthetic_classification, train_steps

PRESETS = ["ddp", "zero1", "fsdp", "zero2", "tp", "fsdp_tp", "pipeline", "hybrid"]


@pytest.mark.parametrize("shape, runner, name", [
    ((1, 1, 1, 1, 1), "single", "single"),
    ((1, 4, 1, 1, 1), "ddp", "ddp"),
    ((1, 1, 4, 1, 1), "layout", "fsdp"),
    ((1, 2, 2, 1, 1), "layout", "hybrid"),
    ((1, 1, 1, 1, 4), "layout", "tp"),
    ((1, 1, 2, 1, 2), "layout", "fsdp_tp"),
    ((1, 2, 1, 1, 2), "layout", "fsdp_tp"),
    ((4, 1, 1, 1, 1), "layout", "pipeline"),
    ((2, 2, 1, 1, 1), "layout", "hybrid"),
    ((2, 1, 2, 1, 2), "layout", "hybrid"),
    ((1, 1, 1, 4, 1), "layout", "fsdp"),
    ((1, 1, 2, 2, 1), "layout", "fsdp"),
])
def test_every_composed_layout_runs_the_one_strategy(shape, runner, name):
    degrees = ParallelDegrees(pipeline_degree=shape[0], replicate_degree=shape[1],
                              shard_degree=shape[2], context_degree=shape[3],
                              tensor_degree=shape[4])
    assert (choose(degrees), layout_name(degrees)) == (runner, name)


def test_typed_options_reach_the_layout():
    layout = Parallel(pp=2, dp_shard=2, sharding=Sharding(reshard_after_forward=False),
                      pipeline=Pipeline(schedule="gpipe"))
    resolved = resolve_strategy("auto", {}, layout, world_size=4, local_world_size=4)
    assert (resolved.name, resolved.layout) == ("hybrid", layout)
    resolved = resolve_strategy("tp", {"loss_parallel": True}, "tp=2", world_size=2,
                                local_world_size=2)
    assert resolved.layout.tensor == TensorParallel(loss_parallel=True)
    hybrid = preset("hybrid", {"pipeline_degree": 2, "pipeline": {"num_microbatches": 2}},
                    local_world_size=4)
    assert hybrid.pipeline == Pipeline(microbatches=2)


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_names_degrees_that_choose_it_or_its_variant(name):
    world = 4
    degrees = preset(name, {}, local_world_size=world).resolve(world_size=world)
    # zero1/zero2 are ddp/fsdp with another optimizer/reshard policy; hybrid's default is
    # HSDP over nodes, which on one node of 4 is plain sharding.
    expected = {"zero1": "ddp", "zero2": "fsdp", "hybrid": "fsdp"}.get(name, name)
    assert (layout_name(degrees) if choose(degrees) == "layout" else choose(degrees)) == expected
    # The preset and its spelled-out degrees agree, so the preset keeps running.
    assert resolve_strategy(name, {}, _spelled(degrees), world_size=world,
                            local_world_size=world).name == name


def _spelled(degrees):
    pp, replicate, shard, cp, tp = degrees.shape
    return Parallel(pp=pp, dp_replicate=replicate, dp_shard=shard, cp=cp, tp=tp)


@pytest.mark.parametrize("name, spec, message", [
    ("fsdp", "dp_replicate=4", r"strategy 'fsdp' means dp_shard=4 on 4 processes but "
                               r"parallel= says dp_replicate=4; drop one of them"),
    ("ps", "dp_shard=4", r"strategy 'ps' is not a layout of degrees"),
    ("auto", "dp_shard=2,tp=2,ep=4", r"Parallel.ep=4 must divide dp_shard x cp = 2"),
    ("ddp", Parallel(dp_shard=4, sharding=Sharding(offload=True)), r"strategy 'ddp' means"),
    ("auto", "dp_shard=4", None),
])
def test_contradictions_are_one_line(name, spec, message):
    if message is None:
        with pytest.raises(ValueError, match=r"strategy_options \['offload'\] need a named"):
            resolve_strategy(name, {"offload": True}, spec, world_size=4, local_world_size=4)
        return
    with pytest.raises(ValueError, match=message):
        resolve_strategy(name, {}, spec, world_size=4, local_world_size=4)


def test_option_set_twice_is_refused():
    with pytest.raises(ValueError, match=r"option 'sequence_parallel' is set both"):
        resolve_strategy("tp", {"sequence_parallel": True},
                         Parallel(tp=2, tensor=TensorParallel(sequence_parallel=True)),
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
