"""Throughput a person reads: FLOP counting, MFU, tokens/s and the progress output."""

import io
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import paratrain
from paratrain.run import flops
from paratrain.run.flops import FirstStepFlops, Throughput, peak_flops_for
from paratrain.run.reporting import Reporter


def dataset(n=48):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g))


def fit(run, *, epochs=1, dropout=0.0, show=False):
    model = nn.Sequential(nn.Linear(4, 16), nn.Dropout(dropout), nn.ReLU(), nn.Linear(16, 3))
    model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = run.loader(dataset(), batch_size=8)
    losses = []
    for _ in run.epochs(epochs):
        for x, y in (run.progress(loader) if show else loader):
            loss = F.cross_entropy(model(x), y)
            run.backward(loss)
            run.step(optimizer)
            losses.append(loss.detach())
    return torch.stack(losses)


# -- FLOPs and MFU ----------------------------------------------------------------------
def test_first_step_flops_of_a_linear_layer_are_the_analytic_count():
    batch, n_in, n_out = 5, 7, 3
    layer = nn.Linear(n_in, n_out, bias=False)
    x = torch.randn(batch, n_in, requires_grad=True)
    counter = FirstStepFlops(enabled=True)
    counter.start((x,), {})
    layer(x).sum().backward()
    counter.stop()
    # forward 2*in*out per sample; backward twice that (grad of input and of weight)
    assert counter.flops_per_sample == 3 * 2 * n_in * n_out
    assert not counter.enabled  # counted once only


def test_run_counts_the_first_step_and_reports_mfu_with_a_peak_override():
    with paratrain.Run(accelerator="cpu", progress=False, peak_flops=1e9) as run:
        fit(run)
        # The first layer's input needs no gradient: forward + weight grad only (2x);
        # the second layer also propagates to its input (3x).
        assert run.throughput.flops_per_sample == 2 * (2 * 4 * 16) + 3 * (2 * 16 * 3)
        stats = run.epoch_stats[0]
        achieved = run.throughput.flops_per_sample * stats["samples_per_s"]
        assert stats["tflops_per_device"] == pytest.approx(achieved / 1e12)
        assert stats["mfu"] == pytest.approx(achieved / 1e9)


def test_mfu_arithmetic_splits_samples_among_replicas():
    rates = Throughput(tokens_per_sample=None, peak_flops=100e12, flops_per_sample=3e9,
                       replicas=2).rates(10_000)
    assert rates["tflops_per_device"] == pytest.approx(15.0)
    assert rates["mfu"] == pytest.approx(0.15)
    assert "tokens_per_s" not in rates
    assert Throughput(tokens_per_sample=None, peak_flops=None, flops_per_sample=3e9,
                      replicas=1).rates(1.0)["mfu"] is None


@pytest.mark.parametrize("name, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", 989.5e12),
    ("NVIDIA H100 PCIe", "bf16", 756.5e12),
    ("NVIDIA H100 NVL", "tf32", 417.5e12),
    ("NVIDIA H200", "fp16", 989.5e12),
    ("NVIDIA A100-SXM4-40GB", "tf32", 156e12),
    ("NVIDIA A100 80GB PCIe", "bf16", 312e12),
    ("NVIDIA L4", "bf16", 121e12),
    ("NVIDIA L40S", "bf16", 362.05e12),
    ("NVIDIA A10G", "fp32", 31.2e12),
    ("Tesla V100-SXM2-16GB", "tf32", 15.7e12),  # no TF32 units: the fp32 rate
    ("Tesla V100-PCIE-32GB", "fp16", 112e12),
    ("Tesla V100-SXM2-32GB", "bf16", None),
    ("Tesla T4", "fp16", 65e12),
    ("NVIDIA GeForce RTX 4090", "bf16", 165.2e12),
    ("NVIDIA GeForce RTX 3090", "fp32", 35.6e12),
    ("NVIDIA GeForce RTX 3090 Ti", "fp32", None),
    ("Some Future GPU", "bf16", None),
])
def test_peak_table_is_matched_on_the_device_name(name, dtype, peak):
    assert peak_flops_for(name, dtype) == peak


def test_compute_dtype_follows_precision_and_matmul_setting(monkeypatch):
    assert flops.compute_dtype("bf16-mixed") == "bf16"
    assert flops.compute_dtype("16-mixed") == "fp16"
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert flops.compute_dtype("32") == "tf32"
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert flops.compute_dtype("32") == "fp32"


def test_cpu_without_override_counts_nothing_and_reports_mfu_as_missing(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with paratrain.Run(accelerator="cpu", progress=False, metrics_path=str(path)) as run:
        assert flops.device_peak_flops(device=run.device, precision="32", override=None) is None
        fit(run)
        assert not run._flop_counter.enabled and run.throughput.flops_per_sample is None
    row = json.loads(path.read_text().splitlines()[0])
    assert row["mfu"] is None and "tflops_per_device" not in row


def test_tokens_per_second_in_stats_and_metrics_log(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with paratrain.Run(accelerator="cpu", progress=False, tokens_per_sample=128,
                       peak_flops=1e12, metrics_path=str(path)) as run:
        fit(run)
        stats = run.epoch_stats[0]
        assert stats["tokens_per_s"] == pytest.approx(128 * stats["samples_per_s"])
    row = json.loads(path.read_text().splitlines()[0])
    assert row["tokens_per_s"] == pytest.approx(stats["tokens_per_s"])
    assert row["mfu"] == pytest.approx(stats["mfu"]) and row["mfu"] > 0


def test_flop_counting_keeps_the_losses_bitwise_identical():
    with paratrain.Run(accelerator="cpu", progress=False) as run:
        plain = fit(run, epochs=2, dropout=0.3)
    with paratrain.Run(accelerator="cpu", progress=False, peak_flops=1e12) as run:
        counted = fit(run, epochs=2, dropout=0.3)
        assert run.throughput.flops_per_sample is not None
    assert torch.equal(plain, counted)


@pytest.mark.parametrize("field, value", [
    ("tokens_per_sample", 0), ("tokens_per_sample", 1.5), ("tokens_per_sample", True),
    ("peak_flops", -1.0), ("peak_flops", "989e12"),
])
def test_bad_throughput_options_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        paratrain.RunConfig(**{field: value})


# -- the progress output ------------------------------------------------------------------
class _Terminal(io.StringIO):
    def isatty(self):
        return True


def _show(stream, *, rates=None, batches=4):
    reporter = Reporter(is_main=True, show_progress=True, metrics=None, stream=stream)
    list(reporter.progress(range(batches), total_samples=16 * batches, samples_per_batch=16,
                           desc="epoch 0", rates=rates))
    return stream.getvalue()


def test_log_file_gets_one_clean_line_per_epoch():
    out = _show(io.StringIO())
    lines = out.splitlines()
    assert len(lines) == 1 and "\r" not in out
    assert lines[0].startswith("epoch 0: 64/64 samples (100%)")
    assert " 0%" not in out and all(line.strip() for line in lines)
    assert out.count("sample/s") + out.count("samples/s") == 1


def test_terminal_bar_shows_the_speed_once():
    out = _show(_Terminal())
    final = out.split("\r")[-1]
    assert "100%" in final
    assert final.count("samples/s") == 1 and "sample/s" not in final.replace("samples/s", "")


def test_bar_shows_tokens_and_mfu():
    rates = Throughput(tokens_per_sample=100, peak_flops=1e9, flops_per_sample=1e6,
                       replicas=1).bar_rates
    out = _show(io.StringIO(), rates=rates)
    assert "tokens/s" in out and "FLOP/s" in out and "MFU " in out and "%" in out


def test_bar_leaves_mfu_out_on_cpu_without_a_peak():
    rates = Throughput(tokens_per_sample=None, peak_flops=None, flops_per_sample=None,
                       replicas=1).bar_rates
    assert "MFU" not in _show(io.StringIO(), rates=rates)
    gpu = Throughput(tokens_per_sample=None, peak_flops=None, flops_per_sample=None,
                     replicas=1, on_gpu=True).bar_rates
    assert "MFU n/a" in _show(io.StringIO(), rates=gpu)


def test_run_progress_in_a_log_prints_a_line_per_epoch(capsys):
    with paratrain.Run(accelerator="cpu", progress=True, tokens_per_sample=10) as run:
        fit(run, epochs=2, show=True)
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in err] == ["epoch 0", "epoch 1"]
    assert all("48/48 samples (100%)" in line and "tokens/s" in line for line in err)


def test_progress_over_a_users_dataloader_counts_its_samples(capsys):
    from torch.utils.data import DataLoader

    with paratrain.Run(accelerator="cpu", progress=True) as run:
        model = nn.Linear(4, 3)
        model, optimizer = run.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        loader = DataLoader(dataset(200), batch_size=32, shuffle=True)
        for _ in run.epochs(1):
            for x, y in run.progress(loader):
                run.backward(F.cross_entropy(model(x), y))
                run.step(optimizer)
    assert "epoch 0: 200/200 samples (100%)" in capsys.readouterr().err
    assert run.epoch_stats[0]["samples"] == 200  # 6 batches of 32 and one of 8


@pytest.mark.parametrize("drop_last, total", [(False, 4100), (True, 4096)])
def test_progress_sizes_a_distributed_sampler_loader_by_data_parallel_ranks(drop_last, total):
    from torch.utils.data import DataLoader, DistributedSampler

    from paratrain.run.samples import SampleCounter

    data = dataset(4100)
    sampler = DistributedSampler(data, num_replicas=2, rank=0, shuffle=False)
    loader = DataLoader(data, batch_size=32, sampler=sampler, drop_last=drop_last)
    counter = SampleCounter()
    batches, planned, per_batch = counter.plan(loader, 2)
    assert (planned, per_batch) == (total, 64)  # global: 2 data-parallel ranks of 32
    assert len(list(batches)) == len(loader)
    assert counter.in_epoch == total
    counter.restart()
    assert counter.in_epoch == 0
    # A plain list of batches: sized by its batches' leading dimension.
    _, planned, per_batch = counter.plan([torch.zeros(8, 4)] * 3, 2)
    assert (planned, per_batch) == (48, 16)


def test_counting_ends_at_step_when_backward_bypasses_the_run():
    with paratrain.Run(accelerator="cpu", progress=False, peak_flops=1e12) as run:
        model = run.prepare(nn.Linear(4, 2))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(3, 4)).sum().backward()
        run.step(optimizer)
        assert not run._flop_counter.active
        assert run.throughput.flops_per_sample == 2 * (2 * 4 * 2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_run_uses_the_table_peak_and_counts_flops():
    with paratrain.Run(accelerator="cuda", progress=False, precision="bf16-mixed") as run:
        name = torch.cuda.get_device_name(run.device)
        fit(run)
        stats = run.epoch_stats[0]
        peak = peak_flops_for(name, "bf16")
        assert run.throughput.peak_flops == peak
        if peak is None:  # unlisted GPU, or no bf16 units
            assert stats["mfu"] is None
        else:
            assert stats["mfu"] is not None and 0 < stats["mfu"] < 1
