"""The strategy table is the one list of strategies: ``Run``, ``paratrain plan`` and
``paratrain bench`` all read it, so none of them can name a strategy the others lack."""

from __future__ import annotations

import math

import pytest

from paratrain.bench import jobs as bench_jobs
from paratrain.bench.rows import GPU_DEFAULT_ROWS, REFERENCE, resolve_rows
from paratrain.plan import STRATEGIES, Hardware, ModelProfile, plan, predict
from paratrain.plan.cli import _build_parser
from paratrain.plan.costs import CostModel
from paratrain.plan.report import PREFERENCE
from paratrain.strategies import available_strategies, strategy_class
from paratrain.strategies.table import STRATEGY_TABLE, StrategyEntry, strategy_entry

TINY = ModelProfile(num_parameters=1000, activation_bytes_per_sample=100.0,
                    compute_time_per_sample=1e-4, num_layers=4, optimizer_step_time=1e-5)
HW = Hardware(num_devices_per_node=2, device_memory_bytes=10**9)


def test_names_are_unique_and_are_what_run_accepts():
    names = [entry.name for entry in STRATEGY_TABLE]
    assert len(names) == len(set(names))
    assert available_strategies() == sorted(names)
    for name in names:
        assert strategy_class(name).name == name  # the lazy target builds that strategy


def test_every_strategy_has_a_cost_model_or_says_why_not():
    for entry in STRATEGY_TABLE:
        assert entry.modelled != bool(entry.not_modelled), entry.name
        if not entry.modelled:
            assert len(entry.not_modelled) > 20, entry.name  # a reason, not a flag
    with pytest.raises(ValueError, match="exactly one of cost_model and not_modelled"):
        StrategyEntry(name="x", target="m:C")
    with pytest.raises(ValueError, match="exactly one of cost_model and not_modelled"):
        StrategyEntry(name="x", target="m:C", cost_model="m:X", not_modelled="because")
    # Rows without a cost model are covered in tests/plan/test_plan_cluster.py.


@pytest.mark.parametrize("entry", [e for e in STRATEGY_TABLE if e.modelled], ids=lambda e: e.name)
def test_each_cost_model_imports_and_predicts_a_tiny_profile(entry):
    model = entry.load_cost_model()
    assert isinstance(model, CostModel)
    p = predict(entry.name, TINY, HW, batch_size_per_device=4)
    assert p.modelled and p.applicable, p.note
    assert math.isfinite(p.step_time) and p.step_time > 0
    assert p.samples_per_second > 0 and 0 < p.memory_bytes < 10**9 and p.fits


def test_the_planner_names_exactly_the_runtimes_strategies():
    runtime = set(available_strategies())
    assert set(STRATEGIES) == runtime and set(PREFERENCE) == runtime
    report = plan(TINY, HW, batch_size_per_device=4)
    assert [p.strategy for p in report.predictions] == list(STRATEGIES)
    assert report.recommendation in runtime
    assert strategy_entry(report.recommendation).modelled
    default = _build_parser().parse_args([]).strategies.split(",")
    assert sorted(default) == sorted(runtime)
    with pytest.raises(ValueError, match="unknown 'zero3'"):
        plan(TINY, HW, batch_size_per_device=4, strategies=["zero3"])


def test_bench_rows_name_only_registered_strategies():
    runtime = set(available_strategies())
    assert REFERENCE in runtime and strategy_entry(REFERENCE).single_process
    assert {label.partition("+")[0] for label in GPU_DEFAULT_ROWS} <= runtime
    assert {r.strategy for r in resolve_rows(None, accelerator="cpu")} == runtime
    with pytest.raises(ValueError, match="unknown zero3"):
        resolve_rows(["zero3"])


def test_bench_launches_servers_where_the_table_says():
    assert bench_jobs.server_args("ps") == (1, ["--ps-servers", "1"])
    assert bench_jobs.server_args("ddp") == (0, [])
    with pytest.raises(ValueError, match="go together"):
        StrategyEntry(name="x", target="m:C", cost_model="m:X", server_processes=1)
