"""The pure parts of benchmarks/plan_validation_tp.py: job order and the tp profile."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

from plan_validation_tp import (  # noqa: E402
    cell_order,
    contention,
    dispatch_time,
    tensor_profile,
    without_tensor_fields,
)

from paratrain.plan import ModelProfile  # noqa: E402


def base(**kw):
    return ModelProfile(**{"num_parameters": 1000, "activation_bytes_per_sample": 10.0,
                           "compute_time_per_sample": 0.01, "optimizer_step_time": 0.02,
                           "tp_allreduces": 6, "tp_allreduce_bytes_per_sample": 60.0,
                           "tp_split_fraction": 0.8, "tp_split_param_fraction": 0.9, **kw})


def test_ddp_runs_right_before_the_tensor_rows_of_each_cell():
    assert cell_order(["tp", "fsdp", "ddp"], [2], ["loopback", "1gbit"]) == [
        ("ddp", 2, "loopback"), ("tp", 2, "loopback"), ("ddp", 2, "1gbit"), ("tp", 2, "1gbit"),
        ("fsdp", 2, "loopback"), ("fsdp", 2, "1gbit")]
    assert cell_order(["ddp", "ps"], [2, 3], ["loopback"]) == [
        ("ddp", 2, "loopback"), ("ddp", 3, "loopback"), ("ps", 2, "loopback"),
        ("ps", 3, "loopback")]


def test_contention_compares_ddps_in_situ_compute_with_one_process():
    ddp = {"batch_size": 8, "compute_step_s": [0.2, 0.3, 0.25], "optimizer_step_s": 0.05}
    assert contention(base(), ddp) == pytest.approx((0.25 + 0.05) / (8 * 0.01 + 0.02))
    assert contention(base(), None) == 1.0


def test_dispatch_is_what_a_rank_computes_beyond_the_split_share():
    # Split share at t = 2: 0.8 / 2 + 0.2 = 0.6 of the whole model's 8 x 10 ms.
    assert dispatch_time(base(), 0.75, 2, 8) == pytest.approx(0.15 * 0.08)
    assert dispatch_time(base(), 0.5, 2, 8) == 0.0


def test_tensor_profile_scales_and_the_fallback_forgets_the_fields():
    pr = tensor_profile(base(), 2.0, 0.01)
    assert (pr.compute_time_per_sample, pr.optimizer_step_time, pr.tp_dispatch_time) == \
        pytest.approx((0.02, 0.04, 0.02))
    old = without_tensor_fields(pr)
    assert (old.tp_allreduces, old.tp_split_fraction, old.tp_split_param_fraction,
            old.tp_dispatch_time) == (0, 1.0, 1.0, 0.0)
    assert old.compute_time_per_sample == pr.compute_time_per_sample
