"""Fault-tolerance options and launcher flags: pure checks, one line each."""

import pytest

from paratrain.fault_tolerance import FaultTolerance, resolve
from paratrain.fault_tolerance.options import parse_replica_group
from paratrain.launch import fault_tolerant
from paratrain.launch import launcher as launch


def test_defaults_nest_collective_step_quorum():
    ft = FaultTolerance()
    assert ft.collective_timeout_s < ft.step_timeout_s < ft.quorum_timeout_s


@pytest.mark.parametrize("fields, message", [
    ({"collective_timeout_s": 30.0, "step_timeout_s": 30.0},
     r"collective_timeout_s \(30 s\) must be shorter than step_timeout_s \(30 s\)"),
    ({"step_timeout_s": 90.0}, r"step_timeout_s \(90 s\) must be shorter than quorum_timeout_s"),
    ({"collective_timeout_s": 0.5, "step_timeout_s": 1.0, "quorum_timeout_s": 2.0},
     "must outlast the lighthouse's heartbeat"),
    ({"min_groups": 0}, "min_groups must be an integer >= 1"),
    ({"step_timeout_s": float("nan")}, "step_timeout_s must be a number of seconds > 0"),
])
def test_an_impossible_timeout_order_is_one_line(fields, message):
    with pytest.raises(ValueError, match=message):
        FaultTolerance(**fields)


def test_options_from_a_dict_refuse_unknown_fields():
    assert FaultTolerance.coerce({"min_groups": 2}).min_groups == 2
    with pytest.raises(ValueError, match=r"fault_tolerance has unknown field\(s\) \['heartbeat'\]"):
        FaultTolerance.coerce({"heartbeat": 1})


@pytest.mark.parametrize("text", ["2/2", "1", "-1/2", "a/b", "0/0"])
def test_replica_group_variable_is_checked(text):
    with pytest.raises(ValueError, match="PARATRAIN_REPLICA_GROUP must be GROUP/GROUPS"):
        parse_replica_group(text)


def test_resolve_needs_the_launcher():
    assert resolve(None, None, None) is None
    with pytest.raises(ValueError, match="paratrain launch --fault-tolerant"):
        resolve({"min_groups": 1}, None, None)
    with pytest.raises(ValueError, match="PARATRAIN_LIGHTHOUSE is not set"):
        resolve(None, "0/2", None)
    ft, group = resolve(None, "1/3", "http://h:1")
    assert (group.index, group.count, group.lighthouse) == (1, 3, "http://h:1")
    assert ft == FaultTolerance()


@pytest.mark.parametrize("argv, message", [
    (["--replica-groups", "2"], "--replica-groups needs --fault-tolerant"),
    (["--fault-tolerant"], "--fault-tolerant needs --replica-groups R"),
    (["--fault-tolerant", "--replica-groups", "2", "--min-groups", "3"],
     r"--min-groups must be between 1 and --replica-groups \(2\)"),
    (["--fault-tolerant", "--replica-groups", "2", "--replica-group", "2"],
     r"--replica-group must be in \[0, 2\)"),
    (["--fault-tolerant", "--replica-groups", "2", "--replica-group", "1"],
     "give the running lighthouse's address with --lighthouse"),
    (["--fault-tolerant", "--replica-groups", "2", "--lighthouse", "host:1"],
     "--lighthouse must be http://HOST:PORT"),
])
def test_launcher_flags_are_checked_before_anything_starts(argv, message):
    args = launch.build_parser().parse_args([*argv, __file__])
    with pytest.raises(ValueError, match=message):
        fault_tolerant.launch(args, [])


def test_one_group_per_launch_only_sets_its_variables(monkeypatch):
    # Recorded as unset first, so that teardown removes what launch() sets: a leaked
    # variable would make every later test's Run() a replica group.
    monkeypatch.delenv("PARATRAIN_REPLICA_GROUP", raising=False)
    monkeypatch.delenv("PARATRAIN_LIGHTHOUSE", raising=False)
    args = launch.build_parser().parse_args(["--fault-tolerant", "--replica-groups", "3",
                                             "--replica-group", "2", "--lighthouse",
                                             "http://h:5", __file__])
    assert fault_tolerant.launch(args, []) is None  # the caller launches this group
    import os
    assert os.environ["PARATRAIN_REPLICA_GROUP"] == "2/3"
    assert os.environ["PARATRAIN_LIGHTHOUSE"] == "http://h:5"


def test_the_variables_set_above_did_not_leak():
    import os
    assert "PARATRAIN_REPLICA_GROUP" not in os.environ
    assert "PARATRAIN_LIGHTHOUSE" not in os.environ


def test_float16_loss_scaling_is_refused_with_replica_groups():
    from types import SimpleNamespace

    from paratrain.fault_tolerance.axis import replica_groups
    settings = SimpleNamespace(replica_group="0/2", lighthouse="http://h:1")
    with pytest.raises(ValueError, match="precision='16-mixed' is not supported"):
        replica_groups(None, settings, None, print, None, "16-mixed")
