"""Fault plans parsed from the environment (pure logic, no processes)."""

from __future__ import annotations

import random

import pytest

from paratrain.reliability import faults
from paratrain.reliability.faults import FaultPlan


def test_no_variables_inject_nothing():
    plan = FaultPlan.from_env(rank=0, environ={})
    assert (plan.kill_at_step, plan.term_at_step, plan.delay_s) == (None, None, 0.0)


def test_straggler_applies_to_its_rank_only():
    env = {"PARATRAIN_STRAGGLER": "1:0.25"}
    assert FaultPlan.from_env(rank=1, environ=env).delay_s == 0.25
    assert FaultPlan.from_env(rank=0, environ=env).delay_s == 0.0


def test_straggler_star_and_probability():
    env = {"PARATRAIN_STRAGGLER": "*:0.5:0.25"}
    plans = [FaultPlan.from_env(rank=r, environ=env) for r in range(3)]
    assert [(p.delay_s, p.delay_probability) for p in plans] == [(0.5, 0.25)] * 3


def test_random_straggler_sleeps_about_its_share(monkeypatch):
    slept = []
    monkeypatch.setattr(faults.time, "sleep", slept.append)
    plan = FaultPlan.from_env(rank=2, environ={"PARATRAIN_STRAGGLER": "*:0.01:0.3"})
    state = random.getstate()
    for step in range(2000):
        plan.after_step(step)
    assert random.getstate() == state  # the training's generator is untouched
    assert set(slept) == {0.01}
    assert 0.25 < len(slept) / 2000 < 0.35
    # Seeded by rank: the same rank repeats the same pattern.
    again = FaultPlan.from_env(rank=2, environ={"PARATRAIN_STRAGGLER": "*:0.01:0.3"})
    pattern = [again.draws.random() < 0.3 for _ in range(50)]
    first = FaultPlan.from_env(rank=2, environ={"PARATRAIN_STRAGGLER": "*:0.01:0.3"})
    assert pattern == [first.draws.random() < 0.3 for _ in range(50)]


@pytest.mark.parametrize("value", ["1", "x:0.1", "1:abc", "1:-1", "1:0.1:2", "1:0.1:0.5:3"])
def test_bad_straggler_is_one_clear_error(value):
    with pytest.raises(ValueError, match="PARATRAIN_STRAGGLER=.*RANK:SECONDS"):
        FaultPlan.from_env(rank=0, environ={"PARATRAIN_STRAGGLER": value})


def test_kill_only_in_the_first_attempt():
    env = {"PARATRAIN_KILL_AT_STEP": "5", "PARATRAIN_KILL_RANK": "1"}
    assert FaultPlan.from_env(rank=1, environ=env).kill_at_step == 5
    assert FaultPlan.from_env(rank=0, environ=env).kill_at_step is None
    restarted = {**env, "TORCHELASTIC_RESTART_COUNT": "1"}
    assert FaultPlan.from_env(rank=1, environ=restarted).kill_at_step is None
