import dataclasses

import pytest

import paratrain
from paratrain.config import RunConfig
from paratrain.distributed.topology import Topology
from paratrain.fieldtypes import field_types
from paratrain.strategies import available_strategies, create_strategy, strategy_class


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"precision": "fp8"}, "precision"),
        ({"accumulate": 0}, "accumulate"),
        ({"max_grad_norm": -1.0}, "max_grad_norm"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"accelerator": "tpu"}, "accelerator"),
        ({"checkpoint_every": 5}, "checkpoint_every needs checkpoint_dir"),
        ({"keep_checkpoints": 0}, "keep_checkpoints"),
        ({"metrics_path": "m.txt"}, "metrics_path"),
        ({"strategy": ""}, "strategy"),
    ],
)
def test_bad_field_is_named(kwargs, field):
    with pytest.raises(ValueError, match=field):
        RunConfig(**kwargs)


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        RunConfig("ddp")  # type: ignore[misc]


def test_unknown_strategy_lists_choices():
    with pytest.raises(ValueError, match="unknown strategy 'zero9'.*ddp"):
        create_strategy("zero9", Topology())


def test_unknown_strategy_option_is_named():
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['bucket_mb'\].*bucket_cap_mb"):
        create_strategy("ddp", Topology(), {"bucket_mb": 3})


def test_strategy_option_is_validated():
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        create_strategy("ddp", Topology(), {"bucket_cap_mb": 0})


def test_auto_resolves_by_world_size():
    assert create_strategy("auto", Topology()).name == "single"
    assert create_strategy("auto", Topology(rank=0, world_size=2, local_world_size=2)).name == "ddp"


def test_dp_falls_back_on_cpu_with_notice():
    strategy = create_strategy("dp", Topology())
    assert not strategy.active
    assert "running as 'single'" in strategy.notice()


def test_dp_refuses_multi_process_jobs():
    with pytest.raises(ValueError, match="use strategy='ddp'"):
        create_strategy("dp", Topology(rank=0, world_size=2, local_world_size=2))


def test_registry_has_foundation_strategies():
    assert {"single", "dp", "ddp"} <= set(available_strategies())


# -- types: one line naming the field and the type, not a traceback -----------------------
@pytest.mark.parametrize("kwargs, line", [
    ({"timeout_s": "300"}, "timeout_s must be a finite number, got '300' (str)"),
    ({"timeout_s": float("inf")}, "timeout_s must be a finite number, got inf (float)"),
    ({"checkpoint_dir": "c", "checkpoint_every": "100"},
     "checkpoint_every must be an integer or None, got '100' (str)"),
    ({"keep_checkpoints": None}, "keep_checkpoints must be an integer, got None (NoneType)"),
    ({"seed": "42"}, "seed must be an integer, got '42' (str)"),
    ({"accumulate": True}, "accumulate must be an integer, got True (bool)"),
    ({"progress": "no"}, "progress must be True or False, got 'no' (str)"),
    ({"peak_flops": float("inf")}, "peak_flops must be a finite number or None, got inf (float)"),
    ({"max_grad_norm": float("nan")}, "max_grad_norm must be a number or None, got nan (float)"),
    ({"metrics_path": 3}, "metrics_path must be a string, a path or None, got 3 (int)"),
    ({"strategy_options": ["bucket_cap_mb", 50]},
     "strategy_options must be a dict keyed by strings, got ['bucket_cap_mb', 50] (list)"),
])
def test_wrong_type_is_one_line(kwargs, line):
    with pytest.raises(ValueError) as info:
        RunConfig(**kwargs)
    assert str(info.value) == line


def test_wrong_type_through_run_is_one_line():
    with pytest.raises(ValueError, match=r"^seed must be an integer, got '42' \(str\)$"):
        paratrain.Run(environ={}, progress=False, seed="42")


def test_infinite_max_grad_norm_still_measures_without_clipping():
    assert RunConfig(max_grad_norm=float("inf")).max_grad_norm == float("inf")


def test_paths_are_accepted_as_strings(tmp_path):
    config = RunConfig(checkpoint_dir=tmp_path, metrics_path=tmp_path / "m.csv",
                       tensorboard_dir=tmp_path / "tb")
    assert (config.checkpoint_dir, config.metrics_path, config.tensorboard_dir) == (
        str(tmp_path), str(tmp_path / "m.csv"), str(tmp_path / "tb"))


def test_misspelled_argument_suggests_the_field():
    with pytest.raises(ValueError) as info:
        paratrain.Run(environ={}, checkpoint_directory="ckpt")
    assert str(info.value) == ("Run() got an unknown argument 'checkpoint_directory'; did you "
                               "mean 'checkpoint_dir'?")
    with pytest.raises(ValueError, match=r"unknown argument 'xyzzy'; the arguments are strategy, "):
        RunConfig.from_arguments({"xyzzy": 1})


@pytest.mark.parametrize("options, line", [
    ({"bucket_cap_mb": "50"},
     "strategy_options['bucket_cap_mb'] of strategy 'ddp' must be a finite number, got '50' (str)"),
    ({"find_unused_parameters": 1},
     "strategy_options['find_unused_parameters'] of strategy 'ddp' must be True or False, "
     "got 1 (int)"),
])
def test_strategy_option_type_is_one_line(options, line):
    with pytest.raises(ValueError) as info:
        create_strategy("ddp", Topology(), options)
    assert str(info.value) == line


def test_strategy_option_types_of_other_strategies():
    with pytest.raises(ValueError, match=r"\['num_microbatches'\] of strategy 'pipeline' must "
                                         r"be an integer, got '4' \(str\)"):
        create_strategy("pipeline", Topology(), {"num_microbatches": "4"})
    with pytest.raises(ValueError, match=r"\['staleness'\] of strategy 'ps' must be an integer"):
        create_strategy("ps", Topology(), {"mode": "ssp", "staleness": True})


@pytest.mark.parametrize("name", available_strategies())
def test_every_strategy_option_has_a_checkable_type(name):
    """Each option's annotation resolves, so its type is checked, not skipped."""
    options = strategy_class(name).Options
    assert set(field_types(options)) == {f.name for f in dataclasses.fields(options)}


def test_run_signature_lists_every_config_field_with_its_default():
    import dataclasses
    import inspect

    import paratrain
    from paratrain.config import RunConfig

    signature = inspect.signature(paratrain.Run)
    named = {n: p for n, p in signature.parameters.items()
             if p.kind is inspect.Parameter.KEYWORD_ONLY}
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    assert set(named) - {"environ"} == set(fields)
    # Two arguments default to None on purpose: strategy_options (a fresh dict) and
    # timeout_s (PARATRAIN_TIMEOUT_S, then RunConfig's default).
    for name, field in fields.items():
        if name in ("strategy_options", "timeout_s"):
            assert named[name].default is None
        else:
            assert named[name].default == field.default, name
