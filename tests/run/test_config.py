import pytest

from paratrain.config import RunConfig
from paratrain.distributed.topology import Topology
from paratrain.strategies import available_strategies, create_strategy


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
