"""Rows of ``paratrain bench``: strategy x precision, the device, and the seeds' table columns."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from paratrain.bench.report import BenchReport, BenchRow, add_scaling_efficiency, row_from_results
from paratrain.bench.rows import GPU_DEFAULT_ROWS, resolve_accelerator, resolve_rows
from paratrain.bench.runner import BenchConfig, bench, preflight
from paratrain.bench.worker import JobSpec

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def labels(rows):
    return [r.label for r in rows]


def test_cpu_default_is_every_strategy_at_float32():
    from paratrain.strategies import available_strategies

    rows = resolve_rows(None, accelerator="cpu")
    assert sorted(labels(rows)) == available_strategies() and rows[0].label == "single"
    assert {r.precision for r in rows} == {"32"}


def test_cuda_default_is_the_seeds_table():
    assert labels(resolve_rows(None, accelerator="cuda")) == list(GPU_DEFAULT_ROWS)
    assert GPU_DEFAULT_ROWS == ("single", "ddp", "ddp+bf16-mixed", "fsdp", "dp")


def test_precisions_multiply_plain_names_and_suffixes_stay():
    rows = resolve_rows(["ddp", "fsdp+bf16-mixed", "single"], precisions=["32", "bf16-mixed"])
    assert labels(rows) == ["single", "single+bf16-mixed", "ddp", "ddp+bf16-mixed",
                            "fsdp+bf16-mixed"]


@pytest.mark.parametrize(("requested", "precisions", "message"), [
    (["ddp+fp8"], ["32"], "precisions: unknown fp8; choose from 32, bf16-mixed"),
    (["ddp"], ["fp4"], "precisions: unknown fp4"),
    (["magic+bf16-mixed"], ["32"], "strategies: unknown magic; registered: "),
])
def test_bad_rows_are_named(requested, precisions, message):
    with pytest.raises(ValueError, match=message):
        resolve_rows(requested, precisions=precisions)


def test_accelerator_auto_follows_cuda_and_cuda_needs_a_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_accelerator("auto") == "cpu"
    with pytest.raises(ValueError, match="no CUDA device is visible; use --accelerator cpu"):
        resolve_accelerator("cuda")
    with pytest.raises(ValueError, match="accelerator"):
        BenchConfig(accelerator="tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_accelerator("auto") == "cuda"
    assert BenchConfig().world_sizes == (1, 4)
    assert BenchConfig(accelerator="cpu").world_sizes == (1, 2)


def test_config_and_job_validate_precision():
    with pytest.raises(ValueError, match="precisions: unknown 8"):
        BenchConfig(precisions=("8",), accelerator="cpu")
    with pytest.raises(ValueError, match="precision must be one of"):
        JobSpec(strategy="ddp", precision="bf15")
    with pytest.raises(ValueError, match="accelerator must be one of"):
        JobSpec(strategy="ddp", accelerator="gpu")


def test_preflight_skips_processes_without_a_gpu_of_their_own(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert preflight("ddp", 2, "cuda") == "needs 2 GPUs (one per process), 1 visible"
    assert preflight("ps", 1, "cuda") == "needs 2 GPUs (one per process), 1 visible"  # + server
    assert preflight("ddp", 1, "cuda") == ""
    assert preflight("ddp", 2, "cpu") == ""


def result(*, step, device="cuda:0", gpu=None, note=""):
    return {"rank": 0, "samples_per_step": 64, "step_s": [step], "compute_step_s": [step / 2],
            "optimizer_step_s": 0.0, "notice": None, "data_parallel_size": 1, "device": device,
            "peak_memory_above_baseline_bytes": 3 * 2**20, "param_bytes": 4, "grad_bytes": 4,
            "optimizer_bytes": 8, "cpu_percent": 99.0, "gpu_percent": gpu, "gpu_note": note}


def seeds_report():
    missing = "n/a (install nvidia-ml-py)"
    rows = [row_from_results("single", 1, [result(step=0.2, note=missing)], epoch_samples=640,
                             num_processes=1),
            row_from_results("ddp", 1, [result(step=0.2, gpu=88.0)], epoch_samples=640,
                             num_processes=1),
            row_from_results("ddp", 1, [result(step=0.1, gpu=75.0)], epoch_samples=640,
                             num_processes=1, precision="bf16-mixed"),
            BenchRow(strategy="fsdp", world_size=2, precision="32", device="cuda",
                     status="skipped", reason="needs 2 GPUs (one per process), 1 visible")]
    add_scaling_efficiency(rows)
    return BenchReport(settings={"accelerator": "cuda"}, rows=rows)


def test_table_has_precision_rows_and_gpu_utilisation_or_why_not():
    lines = seeds_report().format_table().splitlines()
    assert "GPU %" in lines[0] and "peak mem/rank" in lines[0]
    assert lines[2].startswith("single ") and "n/a (install nvidia-ml-py)" in lines[2]
    assert lines[4].startswith("ddp+bf16-mixed") and " 75 " in lines[4]
    assert "640.0" in lines[4] and " 1.0 " in lines[4]  # samples/s and s/epoch of 640 samples
    assert lines[5].startswith("fsdp") and lines[5].endswith("skipped: needs 2 GPUs "
                                                            "(one per process), 1 visible")


def test_efficiency_of_a_precision_row_is_against_its_own_precision():
    report = seeds_report()
    assert report.row("ddp", 1).scaling_efficiency == pytest.approx(1.0)
    assert report.row("ddp+bf16-mixed", 1).scaling_efficiency == pytest.approx(1.0)


def test_json_and_csv_carry_label_precision_device_and_gpu_columns(tmp_path):
    report = seeds_report()
    report.write_json(tmp_path / "b.json")
    report.write_csv(tmp_path / "b.csv")
    rows = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["single", "ddp", "ddp+bf16-mixed", "fsdp"]
    assert rows[2]["precision"] == "bf16-mixed" and rows[2]["device"] == "cuda:0"
    assert rows[0]["gpu_note"] == "n/a (install nvidia-ml-py)" and rows[1]["gpu_percent"] == 88.0
    with open(tmp_path / "b.csv", newline="") as fh:
        table = list(csv.DictReader(fh))
    assert list(table[0])[:5] == ["label", "strategy", "world_size", "precision", "device"]
    assert {"samples_per_s", "seconds_per_epoch", "peak_memory_per_rank", "gpu_percent",
            "gpu_note"} <= set(table[0])
    assert table[2]["label"] == "ddp+bf16-mixed" and table[0]["gpu_percent"] == ""


@pytest.mark.gpu
@needs_cuda
@pytest.mark.slow
def test_bench_on_cuda_measures_gpu_memory_and_bf16_rows(tmp_path):
    report = bench(strategies=("single", "ddp+bf16-mixed"), world_sizes=(1,), batch_size=16,
                   warmup_steps=1, steps=3, repeats=1, timeout_s=300, log=lambda line: None)
    assert report.settings["accelerator"] == "cuda"
    for label in ("single", "ddp+bf16-mixed"):
        row = report.row(label, 1)
        assert row.ok, row.reason
        assert row.device.startswith("cuda") and row.peak_memory_bytes > 0
        assert row.gpu_text() != "-"  # a percentage, or why NVML gave none
