"""Stragglers named: the pure logic (median, margin, floor, patience, which part) and
three gloo ranks with one slowed in forward or in its data, or none."""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from paratrain.config import RunConfig
from paratrain.data.loader import DistributedLoader, ShardedSampler
from paratrain.reliability.stragglers import (
    Accusation,
    StragglerDetector,
    Stragglers,
    describe,
    judge,
    median_of_others,
)
from paratrain.run.reporting import format_rates
from paratrain.testing.pool import spawn

MS = 1e-3


# -- configuration ------------------------------------------------------------------
def test_forms_of_the_option():
    assert Stragglers.parse(True) == Stragglers() == Stragglers(
        check_every=50, margin=1.2, patience=3, min_share=0.05)
    assert Stragglers.parse(False) is None and Stragglers.parse(None) is None
    assert Stragglers.parse({"check_every": 2}) == Stragglers(check_every=2)
    assert RunConfig().stragglers == Stragglers()
    assert RunConfig(stragglers={"margin": 1.5}).stragglers == Stragglers(margin=1.5)
    assert RunConfig(stragglers=False).stragglers is None
    # Parsed twice (dataclasses.replace): the same.
    assert Stragglers.parse(Stragglers.parse({"patience": 5})) == Stragglers(patience=5)


@pytest.mark.parametrize(("value", "message"), [
    ({"check_every": 0}, "stragglers.check_every must be an integer >= 1, got 0"),
    ({"patience": 1.5}, "stragglers.patience must be an integer >= 1, got 1.5"),
    ({"check_every": True}, "stragglers.check_every must be an integer >= 1, got True"),
    ({"margin": 1}, "stragglers.margin must be a number > 1 (e.g. 1.2), got 1"),
    ({"margin": float("nan")}, "stragglers.margin must be a number > 1 (e.g. 1.2), got nan"),
    ({"margin": "2"}, "stragglers.margin must be a number > 1 (e.g. 1.2), got '2'"),
    ({"min_share": 1.0}, "stragglers.min_share must be a number in [0, 1) (e.g. 0.05), got 1.0"),
    ({"every": 5}, "stragglers has unknown field(s) ['every']; known: check_every, margin, "
                   "patience, min_share"),
    ("yes", "stragglers must be True, False, None or a dict such as {'check_every': 50, "
            "'margin': 1.2}, got 'yes'"),
])
def test_bad_values_are_one_line_naming_the_field(value, message):
    with pytest.raises(ValueError) as info:
        RunConfig.from_arguments({"stragglers": value})
    assert str(info.value) == message


# -- one check ----------------------------------------------------------------------
def test_median_of_the_other_ranks():
    assert median_of_others([1.0, 2.0, 3.0, 10.0], 3) == 2.0
    assert median_of_others([1.0, 2.0, 3.0, 10.0], 0) == 3.0
    assert median_of_others([4.0, 6.0], 1) == 4.0  # two ranks: the other one


def _rows(*compute_data, step=100 * MS):
    return [(c * MS, d * MS, step) for c, d in compute_data]


def test_judge_names_the_slow_part():
    accused, ratio = judge(_rows((30, 1), (30, 1), (90, 1), (31, 1)), margin=1.2,
                           min_share=0.05)
    assert accused == Accusation(2, "compute", 3.0) and ratio == 3.0
    accused, ratio = judge(_rows((30, 1), (30, 60), (30, 1)), margin=1.2, min_share=0.05)
    assert (accused.rank, accused.part, ratio) == (1, "data", 60.0)


def test_judge_margin_and_floor():
    # 1.15x the median: under the margin.
    accused, ratio = judge(_rows((30, 1), (30, 1), (34.5, 1)), margin=1.2, min_share=0.05)
    assert accused is None and ratio == pytest.approx(1.15)
    # 4x the median data wait, but 0.3 ms: under 5% of the 100 ms step.
    assert judge(_rows((30, 0.1), (30, 0.4), (30, 0.1)), margin=1.2, min_share=0.05)[0] is None
    # The same 4x over 10 ms is named.
    assert judge(_rows((30, 4), (30, 16), (30, 4)), margin=1.2, min_share=0.05)[0].rank == 1


def test_judge_accuses_the_costliest_only():
    # Rank 0 is 2x slow in compute (+30 ms), rank 1 waits 50 ms more for data.
    accused, _ = judge(_rows((60, 1), (30, 51), (30, 1), (30, 1)), margin=1.2, min_share=0.05)
    assert (accused.rank, accused.part) == (1, "data")
    # Two ranks: each against the other, a 1.5x rank is named (not 1.2x of their mean).
    accused, ratio = judge(_rows((30, 1), (45, 1)), margin=1.2, min_share=0.05)
    assert accused.rank == 1 and ratio == 1.5
    # Every rank equal: the ratio is 1, nobody is named.
    assert judge(_rows((30, 1), (30, 1), (30, 1)), margin=1.2, min_share=0.05) == (None, 1.0)


def test_the_line():
    rows = [(20 * MS, 0.1 * MS, 80 * MS), (60 * MS, 0.1 * MS, 80 * MS),
            (20 * MS, 0.1 * MS, 80 * MS)]
    line = describe(Accusation(1, "compute", 3.0), rows, host="10.0.0.2", checks=3, every=50)
    assert line == (
        "paratrain: rank 1 (host 10.0.0.2) is a straggler, slow in compute (3.00x the other "
        "ranks' median) for 3 checks of 50 steps: per step, compute 60.0 vs 20.0 ms, data "
        "0.1 vs 0.1 ms, backward/optimizer/waiting in collectives 19.9 vs 59.9 ms; step "
        "80.0 ms")
    assert format_rates({"straggler": "1 (compute)"}) == ["straggler=rank 1 (compute)"]


# -- the checks over time -------------------------------------------------------------
class _Script:
    """A detector whose gather returns scripted rows, with what it printed and logged."""

    def __init__(self, patience=3, every=2):
        self.rows, self.printed, self.logged = [], [], []
        self.detector = StragglerDetector(
            Stragglers(check_every=every, patience=patience),
            gather=lambda mine: torch.tensor(self.rows.pop(0), dtype=torch.float64),
            host=lambda rank: f"h{rank}", device=torch.device("cpu"),
            print_fn=self.printed.append,
            log=lambda row, step: self.logged.append((step, row)))
        self.step = 0

    def check(self, rows):
        """Run the steps up to the next check, which sees ``rows``."""
        self.rows.append(rows)
        every = self.detector.options.check_every
        for _ in range(every):
            self.step += 1
            self.detector.after_step(self.step, 0.0)
        assert not self.rows  # the check took them


SLOW = _rows((30, 1), (90, 1), (30, 1))
CLEAN = _rows((30, 1), (31, 1), (30, 1))


def test_named_once_after_patience_checks_in_a_row():
    s = _Script(patience=3)
    rates = s.detector.bar_rates(lambda speed: {"mfu": None})
    s.check(SLOW)
    s.check(SLOW)
    assert s.printed == [] and s.detector.current is None
    assert rates(1.0) == {"mfu": None}
    s.check(SLOW)  # the third in a row: named
    assert len(s.printed) == 1 and s.printed[0].startswith(
        "paratrain: rank 1 (host h1) is a straggler, slow in compute (3.00x")
    assert rates(1.0) == {"mfu": None, "straggler": "1 (compute)"}
    s.check(SLOW)  # still slow: not named again
    assert len(s.printed) == 1 and s.detector.reports == s.printed
    assert [row["straggler"] for _, row in s.logged] == [None, None, 1, 1]
    assert [row["straggler_ratio"] for _, row in s.logged] == [3.0] * 4
    assert [step for step, _ in s.logged] == [2, 4, 6, 8]
    s.check(CLEAN)  # recovered
    assert s.detector.current is None and rates(1.0) == {"mfu": None}
    assert s.detector.take_epoch() == {"straggler": 1, "straggler_ratio": 3.0}
    assert s.detector.take_epoch() == {"straggler": None, "straggler_ratio": None}
    for _ in range(3):  # a new episode is named again
        s.check(SLOW)
    assert len(s.printed) == 2


def test_a_break_or_another_rank_restarts_the_count():
    s = _Script(patience=3)
    other = _rows((90, 1), (30, 1), (30, 1))
    for rows in (SLOW, SLOW, CLEAN, SLOW, SLOW, other, SLOW, SLOW):
        s.check(rows)
    assert s.printed == [] and s.detector.checks == 8
    assert s.detector.take_epoch() == {"straggler": None, "straggler_ratio": 3.0}


def test_off_and_single_process_detectors_do_nothing():
    off = StragglerDetector(None, gather=None, host=None, device=torch.device("cpu"),
                            print_fn=None, log=None)
    model = torch.nn.Linear(2, 2)
    forward = model.forward
    off.watch(model)
    off.after_step(1, 0.5)
    assert model.forward == forward and off.take_epoch() == {}
    import paratrain

    with paratrain.Run(accelerator="cpu", progress=False) as run:  # one process
        assert run._stragglers.options is None
        prepared = run.prepare(torch.nn.Linear(2, 2))
        loader = run.loader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)
        for _ in run.epochs(1):
            for (x,) in loader:
                prepared(x)
        assert "straggler" not in run.epoch_stats[0]


# -- what a rank times ----------------------------------------------------------------
class _SlowData(Dataset):
    """Samples that take ``delay`` seconds each (a slow disk or decoder)."""

    def __init__(self, n: int, delay: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randn(n, 4, generator=g)
        self.delay = delay

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        if self.delay:
            time.sleep(self.delay)
        return self.x[index], self.y[index]


def test_the_loader_times_its_wait():
    sampler = ShardedSampler(8, num_replicas=1, rank=0, shuffle=False)
    loader = DistributedLoader(_SlowData(8, delay=0.01), sampler, batch_size=4,
                               device=torch.device("cpu"), num_workers=0, pin_memory=False,
                               persistent_workers=False)
    assert len(list(loader)) == 2
    waited = loader.take_wait()
    assert 0.08 <= waited < 1.0  # 8 samples of 10 ms
    assert loader.take_wait() == 0.0


def test_the_forward_clock_times_training_forwards_only():
    detector = StragglerDetector(Stragglers(), gather=None, host=None,
                                 device=torch.device("cpu"), print_fn=None, log=None)
    model = _Sleepy(0.02)
    detector.watch(model)
    model(torch.ones(1, 8))
    with torch.no_grad():
        model(torch.ones(1, 8))  # evaluation: not timed
    model.eval()
    model(torch.ones(1, 8))
    assert 0.02 <= detector.clock.read() < 0.035
    assert detector.clock.read() == 0.0


@pytest.mark.gpu
def test_the_forward_clock_reads_cuda_events_at_a_check_only():
    from paratrain.reliability.stragglers import ForwardClock

    clock = ForwardClock(torch.device("cuda"))
    a = torch.randn(2048, 2048, device="cuda")
    torch.cuda.synchronize()
    for _ in range(3):
        started = clock.start()
        for _ in range(20):
            a = torch.tanh(a @ a)
        clock.stop(started)
    seconds = clock.read()  # waits for the last end event only here
    assert seconds > 0 and clock.read() == 0.0
    started = clock.start()
    clock.stop(started)
    assert clock.read(discard=True) == 0.0 and len(clock._free) == 6  # events reused


# -- three gloo ranks ------------------------------------------------------------------
class _Sleepy(torch.nn.Linear):
    """A forward that takes ``delay`` seconds: compute without CPU contention."""

    def __init__(self, delay: float) -> None:
        super().__init__(8, 4)
        self.delay = delay

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.delay)
        return super().forward(x)


# The forward of every rank takes BASE_S. The slow rank's forward (or data) takes 3x as
# long: two loaded cores under three processes wake a sleeper a few ms late now and then,
# so the test's slowdown is well above the 1.2x margin; the 1.5x target of the issue is
# the benchmark's (benchmarks/straggler_cost.py, docs/benchmarks.md).
BASE_S, BATCH, STEPS, EVERY = 0.02, 4, 12, 2


def _worker(rank: int, world_size: int, scenario: str, stragglers: object) -> dict:
    import paratrain

    slow_compute = scenario == "compute" and rank == 2
    slow_data = scenario == "data" and rank == 1
    with paratrain.Run(strategy="ddp", stragglers=stragglers, progress=False) as run:
        torch.manual_seed(0)
        model = _Sleepy(3 * BASE_S if slow_compute else BASE_S)
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        # 2 * BASE_S of waiting per batch: the data part is 3x the forward's time.
        data = _SlowData(STEPS * BATCH * world_size,
                         delay=2 * BASE_S / BATCH if slow_data else 0.0)
        loader = run.loader(data, batch_size=BATCH, shuffle=False)
        losses = []
        for _ in run.epochs(1):
            for x, y in loader:
                loss = F.mse_loss(model(x), y)
                run.backward(loss)
                run.step(optimizer)
                losses.append(loss.detach().clone())
        return {"reports": list(run._stragglers.reports), "checks": run._stragglers.checks,
                "stats": run.epoch_stats[0], "losses": torch.stack(losses)}


def _run(scenario: str, stragglers: object = None) -> list[dict]:
    options = {"check_every": EVERY, "margin": 1.2, "patience": 3}
    return spawn(_worker, 3, scenario, options if stragglers is None else stragglers,
                 timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize(("scenario", "rank"), [("compute", 2), ("data", 1)])
def test_the_slow_rank_is_named_within_three_checks(scenario, rank):
    results = _run(scenario)
    assert results[0]["checks"] == STEPS // EVERY
    (line,) = results[0]["reports"]  # one line, for the slow rank only
    assert line.startswith(f"paratrain: rank {rank} (host 127.0.0.1) is a straggler, slow in "
                           f"{scenario} ("), line
    assert f"for 3 checks of {EVERY} steps" in line  # named at the third check: the first
    for result in results:
        assert result["stats"]["straggler"] == rank
        assert result["stats"]["straggler_ratio"] > 2


@pytest.mark.slow
def test_a_clean_run_names_nobody_and_trains_bitwise_as_without():
    on, off = _run("clean"), _run("clean", stragglers=False)
    assert [r["reports"] for r in on] == [[], [], []]
    # Nobody named; the ratio itself is a timing (1.28 seen on a loaded machine), and
    # only a ratio above the margin for `patience` checks in a row names a rank.
    assert on[0]["stats"]["straggler"] is None and on[0]["stats"]["straggler_ratio"] >= 1.0
    assert "straggler" not in off[0]["stats"] and off[0]["checks"] == 0
    for with_it, without in zip(on, off):
        assert torch.equal(with_it["losses"], without["losses"])
