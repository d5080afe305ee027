"""The bubble computed from torch's schedule plans (pure logic: no process group)."""

import pytest

from paratrain.strategies.pipeline.bubble import COSTS, actions, bubble_fraction, timeline
from paratrain.strategies.pipeline.schedules import SCHEDULE_CLASSES

GRID = [(p, m) for p in (2, 3, 4) for m in (p, 2 * p, 3 * p)]


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p, m", GRID)
def test_one_stage_per_rank_gives_the_textbook_bubble(schedule, p, m):
    # F:B = 1:2, every rank idles p - 1 slots of F + B while the pipeline fills and drains.
    assert bubble_fraction(schedule, p, m) == pytest.approx((p - 1) / (m + p - 1), abs=1e-12)


@pytest.mark.parametrize("v", [2, 3])
@pytest.mark.parametrize("p, m", GRID)
def test_interleaving_divides_the_ramp_by_the_stages_per_rank(v, p, m):
    # Megatron's (p - 1) / (v m + p - 1) (m a multiple of p: full rounds).
    got = bubble_fraction("interleaved_1f1b", p, m, stages_per_rank=v)
    assert got == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12)
    assert got < bubble_fraction("1f1b", p, m)


@pytest.mark.parametrize("schedule", ["interleaved_zero_bubble", "zbv", "dualpipev"])
@pytest.mark.parametrize("p, m", [(2, 4), (2, 8), (3, 6), (4, 8), (4, 16)])
def test_zero_bubble_schedules_idle_less_than_1f1b_and_interleaved(schedule, p, m):
    zero = bubble_fraction(schedule, p, m)
    assert 0 <= zero < bubble_fraction("interleaved_1f1b", p, m) < bubble_fraction("1f1b", p, m)
    # With F = I = W, ZB-V's ranks idle only while the first forward reaches them: p - 1
    # forward slots of a half-size stage, beside their 2 x 3 m units of work.
    if schedule == "zbv":
        assert zero == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)


@pytest.mark.parametrize("schedule", list(SCHEDULE_CLASSES))
def test_every_stage_runs_every_microbatch_once_in_order(schedule):
    p, m = 2, 4
    order = actions(schedule, p, m)
    per_rank = 2 if schedule not in ("gpipe", "1f1b") else 1
    stages = {s for acts in order.values() for _, s, _ in acts}
    assert stages == set(range(p * per_rank))
    for rank, acts in order.items():
        for stage in {s for _, s, _ in acts}:
            forwards = [i for k, s, i in acts if s == stage and k == "F"]
            backwards = [i for k, s, i in acts if s == stage and k in ("B", "I")]
            weights = [i for k, s, i in acts if s == stage and k in ("B", "W")]
            assert forwards == backwards == weights == list(range(m)), (rank, stage)
        # Each rank's work: F + I + W (3 units) per micro-batch per stage it holds.
        assert sum(COSTS[k] for k, _, _ in acts) == 3 * m * per_rank
    if schedule in ("zbv", "dualpipev"):  # a V: rank 0 holds the first and the last stage
        assert {s for _, s, _ in order[0]} == {0, 2 * p - 1}


def test_the_timeline_follows_dependencies_and_refuses_a_deadlock():
    # Two stages, one micro-batch: F0 F1 then B1 B0, each waiting for the other rank.
    order = {0: [("F", 0, 0), ("B", 0, 0)], 1: [("F", 1, 0), ("I", 1, 0), ("W", 1, 0)]}
    spans = timeline(order, 2)
    assert spans[("F", 1, 0)] == (1.0, 2.0)
    assert spans[("B", 0, 0)] == (3.0, 5.0)  # after I of stage 1, not after its W
    assert spans[("W", 1, 0)] == (3.0, 4.0)
    # Rank 0 waits for a backward that rank 1 runs only after rank 0's next forward.
    stuck = {0: [("F", 0, 0), ("B", 0, 0), ("F", 0, 1)],
             1: [("F", 1, 0), ("F", 1, 1), ("B", 1, 0), ("B", 1, 1)]}
    with pytest.raises(ValueError, match="deadlock"):
        timeline(stuck, 2)


def test_bubble_refuses_in_one_line():
    with pytest.raises(ValueError, match="schedule must be one of") as error:
        bubble_fraction("zb", 2, 4)
    assert "\n" not in str(error.value)
    with pytest.raises(ValueError, match="'dualpipev' needs at least 2 x pp = 8"):
        bubble_fraction("dualpipev", 4, 6)
    with pytest.raises(ValueError, match="at least 2 ranks"):
        bubble_fraction("1f1b", 1, 4)
    assert bubble_fraction("interleaved-zero-bubble", 2, 4) == bubble_fraction(
        "interleaved_zero_bubble", 2, 4)
