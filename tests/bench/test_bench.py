"""``paratrain bench``: aggregation and measurements (pure), then one real launched run."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
import torch
from torch import nn

from paratrain.bench import jobs as bench_jobs
from paratrain.bench.cli import main
from paratrain.bench.measure import MemoryWatch, state_bytes
from paratrain.bench.report import (
    BenchReport,
    BenchRow,
    add_scaling_efficiency,
    link_from_probe,
    row_from_results,
)
from paratrain.bench.runner import BenchConfig, preflight, resolve_strategies
from paratrain.bench.worker import JobSpec, make_loss

CONVNET_PARAMS = 431_242


def rank_result(rank, *, step_s, compute_s, peak, opt=0.001, samples=64, **extra):
    return {"rank": rank, "samples_per_step": samples, "step_s": step_s,
            "compute_step_s": compute_s, "optimizer_step_s": opt, "notice": None,
            "data_parallel_size": 2, "peak_memory_above_baseline_bytes": peak,
            "param_bytes": 400, "grad_bytes": 400, "optimizer_bytes": 800,
            "cpu_percent": 90.0 + rank, "system_cpu_percent": 95.0, "gpu_percent": None, **extra}


def test_row_aggregates_median_spread_and_exposed_share():
    results = [rank_result(0, step_s=[0.1, 0.2, 0.16], compute_s=[0.12, 0.11, 0.13], peak=10,
                           link_probe_bytes=1e6, link_probe_s=0.01, link_small_s=2e-4),
               rank_result(1, step_s=[0.1, 0.2, 0.16], compute_s=[0.12, 0.11, 0.13], peak=30)]
    row = row_from_results("ddp", 2, results, epoch_samples=6400, num_processes=2)
    assert row.samples_per_s == pytest.approx(64 / 0.16)
    assert (row.samples_per_s_min, row.samples_per_s_max) == pytest.approx((320, 640))
    assert row.step_time_s == pytest.approx(0.16)
    assert row.exposed_comm_share == pytest.approx((0.16 - 0.12 - 0.001) / 0.16)
    assert row.seconds_per_epoch == pytest.approx(6400 / 400)
    assert row.peak_memory_bytes == 30 and row.peak_memory_per_rank == [10, 30]
    assert row.cpu_percent == pytest.approx(90.5)
    # Ring all-reduce over 2 ranks moves 2 * (1/2) * S per rank.
    assert row.link_bus_bandwidth == pytest.approx(1e6 / 0.01)
    assert row.link_latency_s == pytest.approx(1e-4)


def test_exposed_share_never_negative():
    results = [rank_result(0, step_s=[0.1], compute_s=[0.2], peak=1)]
    assert row_from_results("x", 1, results, epoch_samples=1, num_processes=1).exposed_comm_share == 0


def test_link_from_probe_is_ring_bus_bandwidth_and_per_hop_latency():
    # 4 ranks, 8 MB in 0.1 s: each rank moves 2*3/4 * 8 MB = 12 MB -> 120 MB/s; a 4-byte
    # all-reduce of 0.6 ms is 6 hops of 0.1 ms.
    probe = {"link_probe_ranks": 4, "link_probe_bytes": 8e6, "link_probe_s": 0.1,
             "link_small_s": 6e-4}
    bus, latency = link_from_probe(probe)
    assert bus == pytest.approx(120e6)
    assert latency == pytest.approx(1e-4)
    assert link_from_probe({"data_parallel_size": 1}) == (None, None)
    assert link_from_probe({**probe, "link_probe_ranks": 1}) == (None, None)


def test_scaling_efficiency_uses_single_then_own_baseline():
    rows = [BenchRow(strategy="single", world_size=1, samples_per_s=100.0),
            BenchRow(strategy="ddp", world_size=2, samples_per_s=150.0),
            BenchRow(strategy="other", world_size=1, samples_per_s=50.0),
            BenchRow(strategy="other", world_size=2, samples_per_s=90.0),
            BenchRow(strategy="dp", world_size=2, status="skipped", reason="no")]
    add_scaling_efficiency(rows)
    assert rows[1].scaling_efficiency == pytest.approx(0.75)
    assert rows[3].scaling_efficiency == pytest.approx(90 / 200)  # single beats own baseline
    assert rows[4].scaling_efficiency is None
    alone = [BenchRow(strategy="ddp", world_size=1, samples_per_s=80.0),
             BenchRow(strategy="ddp", world_size=2, samples_per_s=120.0)]
    add_scaling_efficiency(alone)
    assert alone[1].scaling_efficiency == pytest.approx(0.75)


def test_efficiency_above_linear_is_flagged_with_the_baselines_cpu_never_plain():
    # The single baseline measured slow (a busy machine: 45% of a core): ddp x2 would
    # read 165% efficient.
    rows = [row_from_results(name, n, [rank_result(0, step_s=[64 / speed], compute_s=[0.1],
                                                   peak=1, cpu_percent=cpu)],
                             epoch_samples=64, num_processes=n)
            for name, n, speed, cpu in [("single", 1, 100.0, 45.0), ("ddp", 2, 330.0, 99.0),
                                        ("fsdp", 2, 150.0, 99.0)]]
    add_scaling_efficiency(rows)
    assert rows[1].scaling_efficiency == pytest.approx(1.65)
    assert rows[1].efficiency_flag.startswith("above 105%: baseline single x1 (CPU 45%)")
    assert rows[2].scaling_efficiency == pytest.approx(0.75) and rows[2].efficiency_flag == ""
    lines = BenchReport(settings={}, rows=rows).format_table().splitlines()
    assert "165% (!)" in lines[3] and "likely measured slow" in lines[3]
    assert " 75% " in lines[4] + " " and "(!)" not in lines[4]


def test_rows_whose_windows_spread_are_noisy_and_so_is_efficiency_against_them():
    spread = rank_result(0, step_s=[0.1, 0.2, 0.16], compute_s=[0.1] * 3, peak=1)
    steady = rank_result(0, step_s=[0.1, 0.104, 0.102], compute_s=[0.1] * 3, peak=1)
    base = row_from_results("single", 1, [spread], epoch_samples=64, num_processes=1)
    row = row_from_results("ddp", 2, [steady], epoch_samples=64, num_processes=2)
    assert base.noisy and not row.noisy  # 320-640 around 400; 615-640 around 627
    add_scaling_efficiency([base, row])
    assert row.scaling_efficiency == pytest.approx(627.45 / 800, rel=1e-3)
    assert row.efficiency_flag == "baseline single x1 (CPU 90%) noisy: its windows spread over 10%"
    table = BenchReport(settings={}, rows=[base, row]).format_table().splitlines()
    assert "noisy" in table[2] and "(!)" in table[3]


def test_table_lists_skipped_rows_with_reason():
    report = BenchReport(settings={}, rows=[
        row_from_results("ddp", 2, [rank_result(0, step_s=[0.1], compute_s=[0.1], peak=5)],
                         epoch_samples=100, num_processes=2),
        BenchRow(strategy="dp", world_size=2, status="skipped", reason="one process only")])
    lines = report.format_table().splitlines()
    assert lines[0].startswith("strategy") and len(lines) == 4
    assert "640.0" in lines[2] and lines[3].endswith("skipped: one process only")


def test_state_bytes_counts_params_grads_and_adam_state():
    model = nn.Linear(10, 5)  # 55 parameters
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 10)).sum().backward()
    opt.step()
    held = state_bytes(model, opt)
    assert (held.param_bytes, held.grad_bytes) == (55 * 4, 55 * 4)
    assert held.optimizer_bytes == 2 * 55 * 4  # exp_avg + exp_avg_sq; the scalar step is not counted


_WATCH_SCRIPT = """
import torch
from paratrain.bench.measure import MemoryWatch
watch = MemoryWatch(torch.device("cpu"))
block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written so it is resident
print(watch.peak_above_baseline())
"""


def test_memory_watch_sees_a_new_allocation():
    import subprocess
    import sys

    # In a fresh process: in the test process, memory other tests' threads free inside
    # the window lowers the resident size under the baseline and hides the new block.
    done = subprocess.run([sys.executable, "-c", _WATCH_SCRIPT], capture_output=True,
                          text=True, timeout=120, check=True)
    assert int(done.stdout.split()[-1]) >= 60 * 2**20


def test_make_loss_rule():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, requires_grad=True)
    loss = make_loss(logits, 4, gen)(logits)
    assert loss.dim() == 0 and loss.item() > 0
    image = torch.randn(4, 1, 8, 8)
    assert make_loss(image, 4, gen)(image).item() == pytest.approx(image.pow(2).mean().item())


@pytest.mark.parametrize(("factory", "kwargs", "field"), [
    (BenchConfig, {"world_sizes": (0,)}, "world_sizes"),
    (BenchConfig, {"strategies": ()}, "strategies"),
    (BenchConfig, {"batch_size": 0}, "batch_size"),
    (BenchConfig, {"repeats": 0}, "repeats"),
    (BenchConfig, {"threads": 0}, "threads"),
    (BenchConfig, {"optimizer": "lamb"}, "optimizer"),
    (JobSpec, {"strategy": "ddp", "input_shape": (1, 0)}, "input_shape"),
    (JobSpec, {"strategy": "ddp", "model": "nocolon"}, "model"),
])
def test_config_validation_names_the_field(factory, kwargs, field):
    with pytest.raises(ValueError, match=field):
        factory(**kwargs)


def test_strategies_come_from_the_registry():
    from paratrain.strategies import available_strategies

    names = resolve_strategies(None)
    assert sorted(names) == available_strategies() and names[0] == "single"
    with pytest.raises(ValueError, match="unknown magic; registered: "):
        resolve_strategies(["ddp", "magic"])


def test_preflight_reasons():
    assert "one process" in preflight("single", 2)
    assert preflight("single", 1) == ""
    assert "use strategy='ddp'" in preflight("dp", 2)
    assert preflight("ddp", 2) == ""


def test_collect_prefers_the_workers_error(tmp_path):
    (tmp_path / "error-rank1.json").write_text(json.dumps({"rank": 1, "reason": "ValueError: no"}))
    assert bench_jobs.collect(tmp_path, "launcher exited with code 1").reason == "ValueError: no"
    empty = tmp_path / "empty"
    empty.mkdir()
    outcome = bench_jobs.collect(empty, "timed out after 5 s", "a\nlast line\n")
    assert not outcome.ok and outcome.reason == "timed out after 5 s: last line"


@pytest.mark.parametrize(("argv", "flag"), [
    (["--strategies", "ddp,magic"], "strategies"),
    (["no_such_module_xyz:build"], "cannot import model"),
    (["--input-shape", "3,32,32", "--strategies", "ddp"], "input_shape"),
    (["--world-sizes", "0"], "--world-sizes"),
])
def test_cli_bad_input_is_one_line(argv, flag, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err, err


@pytest.mark.slow
def test_bench_ddp_one_and_two_processes_writes_outputs(tmp_path):
    out = {ext: tmp_path / f"bench.{ext}" for ext in ("json", "csv", "png")}
    cmd = [sys.executable, "-m", "paratrain.cli", "bench", "--strategies", "ddp",
           "--world-sizes", "1,2", "--batch-size", "8", "--warmup", "1", "--steps", "2",
           "--repeats", "1", "--timeout", "120",
           *[a for ext, path in out.items() for a in (f"--{ext}", str(path))]]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[0].startswith("strategy")
    data = json.loads(out["json"].read_text())
    rows = {r["world_size"]: r for r in data["rows"]}
    assert sorted(rows) == [1, 2] and all(r["status"] == "ok" for r in rows.values()), rows
    assert rows[2]["samples_per_step"] == 16 and len(rows[2]["peak_memory_per_rank"]) == 2
    assert rows[2]["param_bytes"] == rows[2]["grad_bytes"] == 4 * CONVNET_PARAMS
    assert rows[2]["optimizer_bytes"] == 8 * CONVNET_PARAMS
    assert rows[2]["scaling_efficiency"] == pytest.approx(
        rows[2]["samples_per_s"] / (2 * rows[1]["samples_per_s"]))
    with open(out["csv"], newline="") as fh:
        table = list(csv.DictReader(fh))
    assert [int(r["world_size"]) for r in table] == [1, 2]
    assert float(table[1]["samples_per_s"]) == pytest.approx(rows[2]["samples_per_s"])
    assert out["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_entries_name_their_precision_and_the_gpu_default_is_the_seeds_table():
    assert resolve_strategies(None, cuda=True) == ["single", "ddp", "ddp+bf16-mixed", "fsdp",
                                                   "dp"]
    assert resolve_strategies(["ddp+bf16-mixed", "single"]) == ["single", "ddp+bf16-mixed"]
    with pytest.raises(ValueError, match="precisions: unknown fp8"):
        resolve_strategies(["ddp+fp8"])
    spec = BenchConfig(accelerator="cpu").job_spec("ddp", "bf16-mixed", "cpu")
    assert (spec.strategy, spec.precision, spec.accelerator) == ("ddp", "bf16-mixed", "cpu")


# The console script's sys.path[0] is its own folder, not the working directory
# (``python -m`` would put the working directory first and hide the problem).
CONSOLE_SCRIPT = "import sys\nfrom paratrain.cli import main\nsys.exit(main())\n"


@pytest.mark.slow
def test_a_model_in_the_working_directory_is_found_and_precision_rows_run(tmp_path):
    work, bin_dir = tmp_path / "work", tmp_path / "bin"
    work.mkdir()
    bin_dir.mkdir()
    (bin_dir / "paratrain_script.py").write_text(CONSOLE_SCRIPT)
    (work / "mymodels.py").write_text(
        "import torch.nn as nn\n\ndef mlp():\n"
        "    return nn.Sequential(nn.Flatten(), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))\n")
    json_path = tmp_path / "out.json"
    cmd = [sys.executable, str(bin_dir / "paratrain_script.py"), "bench", "mymodels:mlp",
           "--input-shape", "8", "--strategies", "single,single+bf16-mixed", "--world-sizes", "1",
           "--warmup", "1", "--steps", "2", "--repeats", "1", "--accelerator", "cpu",
           "--json", str(json_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(json_path.read_text())["rows"]
    assert [(r["label"], r["precision"], r["status"], r["device"]) for r in rows] == [
        ("single", "32", "ok", "cpu"), ("single+bf16-mixed", "bf16-mixed", "ok", "cpu")]


@pytest.mark.gpu
def test_memory_watch_on_a_fresh_cuda_device():
    watch = MemoryWatch(torch.device("cuda", 0))  # raised "Invalid device argument" before
    x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    assert watch.peak_above_baseline() >= 64 << 20
    del x
