"""Tests of ``paratrain plan`` on GPU clusters: device choice, synchronized timing,
precision, interconnect presets, device memory, scaling tables, strategies not modelled."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from paratrain.plan import Hardware, ModelProfile, calibrate, plan, predict
from paratrain.plan import calibration as plan_calibrate
from paratrain.plan import device as plan_device
from paratrain.plan.cli import main
from paratrain.plan.links import PRESETS, guess_intra_node, link_preset, resolve_links
from paratrain.plan.scaling import format_scaling, parse_node_counts, plan_scaling
from paratrain.strategies import table

MB = 1e6


def profile(**kw):
    base = {"num_parameters": 1_000_000, "activation_bytes_per_sample": 1000.0,
            "compute_time_per_sample": 1e-3, "num_layers": 8}
    return ModelProfile(**{**base, **kw})


def fake_gpu(monkeypatch, *, name="NVIDIA H100 80GB HBM3", memory=80 * 2**30, count=1):
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "device_count", lambda: count)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "get_device_properties",
                        lambda index: SimpleNamespace(name=name, total_memory=memory))


# --- device selection and timing -------------------------------------------------


def test_select_device_prefers_cuda_when_visible(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plan_device.select_device(None) == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^device: 'cuda' requested but no CUDA"):
        plan_device.select_device("cuda")
    fake_gpu(monkeypatch, count=2)
    assert plan_device.select_device(None) == torch.device("cuda", 0)
    assert plan_device.select_device("cpu") == torch.device("cpu")
    assert plan_device.select_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match=r"^device: 'cuda:2' does not exist \(2 CUDA"):
        plan_device.select_device("cuda:2")
    with pytest.raises(ValueError, match="^device: "):
        plan_device.select_device("tpu")


def test_cuda_clock_synchronizes_before_reading_the_timer(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("sync", device)))
    cuda = torch.device("cuda", 0)
    now = plan_device.make_clock(cuda, timer=lambda: calls.append(("read",)) or 1.0)
    assert now() == 1.0
    assert calls == [("sync", cuda), ("read",)]
    calls.clear()
    plan_device.make_clock(torch.device("cpu"), timer=lambda: 0.0)()
    assert calls == []  # nothing to wait for on the CPU


def test_calibrate_reads_every_time_after_a_synchronize(monkeypatch):
    # Calibration (whole model, each child, optimizer step) only reads time through the
    # device clock; with a recording sync, every read must follow a sync.
    events = []
    counter = iter(range(10**6))

    def clock(device):
        return plan_device.make_clock(device, sync=lambda: events.append("sync"),
                                      timer=lambda: events.append("read") or next(counter) * 1e-3)

    monkeypatch.setattr(plan_calibrate, "make_clock", clock)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    pr = calibrate(model, torch.randn(3, 4), repeats=2, warmup=1, device="cpu", optimizer="adam")
    reads = [i for i, e in enumerate(events) if e == "read"]
    assert reads and all(events[i - 1] == "sync" for i in reads)
    # 3 reads per whole-model pass, 2 per child pass, 2 per optimizer step; 3 passes each.
    assert len(reads) == 3 * 3 + 3 * 3 * 2 + 3 * 2
    assert pr.compute_time_per_sample == pytest.approx(2e-3 / 3)  # fake clock: 2 ticks per pass
    assert pr.optimizer_step_time == pytest.approx(1e-3)


def test_calibrate_precision_and_copies(monkeypatch):
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.randn(4, 64)
    fp32 = calibrate(model, x, repeats=1, device="cpu")
    mixed = calibrate(model, x, repeats=1, device="cpu", precision="bf16-mixed")
    # The forward ran under autocast: Linear outputs are bf16, master weights stay fp32.
    assert mixed.chain[0][1] == fp32.chain[0][1] / 2
    assert mixed.param_bytes == 4
    true = calibrate(model, x, repeats=1, device="cpu", precision="bf16-true")
    assert true.param_bytes == 2
    assert all(p.dtype == torch.float32 and p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="precision must be one of"):
        calibrate(model, x, precision="fp8")
    with pytest.raises(ValueError, match="optimizer"):
        calibrate(model, x, optimizer="lamb")


def test_optimizer_step_leaves_parameters_and_is_charged_per_shard():
    model = nn.Linear(16, 16)
    before = [p.detach().clone() for p in model.parameters()]
    pr = calibrate(model, torch.randn(2, 16), repeats=1, device="cpu", optimizer="adam")
    assert pr.optimizer_step_time > 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    pr = profile(optimizer_step_time=4e-3)
    hw = Hardware(intra_node_bandwidth=1e12, inter_node_bandwidth=1e12, intra_node_latency=0.0,
                  inter_node_latency=0.0, num_devices_per_node=4)
    single = predict("single", pr, hw, batch_size_per_device=4)
    assert single.step_time == pytest.approx(4 * 1e-3 + 4e-3)
    assert single.scaling_efficiency == pytest.approx(1.0)
    assert predict("fsdp", pr, hw, batch_size_per_device=4).optimizer_time == pytest.approx(1e-3)
    # Synchronous ps: the workers wait while the servers step their shards.
    assert predict("ps", pr, hw, batch_size_per_device=4,
                   num_servers=2).optimizer_time == pytest.approx(2e-3)


# --- interconnects ----------------------------------------------------------------


def test_every_preset_has_bandwidth_latency_and_sources():
    assert len(PRESETS) >= 12
    for preset in PRESETS.values():
        assert preset.bandwidth > 0 and preset.latency > 0, preset.name
        assert preset.source and preset.latency_source, preset.name
    # Unidirectional per-GPU / per-port peak figures, in bytes/s.
    assert link_preset("nvlink").bandwidth == 450e9  # H100: 900 GB/s bidirectional
    assert link_preset("NVLink3").bandwidth == 300e9  # A100: 600 GB/s bidirectional
    assert link_preset("pcie4").bandwidth == pytest.approx(31.5e9, rel=1e-3)
    assert link_preset("pcie5").bandwidth == pytest.approx(63.0e9, rel=1e-3)
    assert link_preset("infiniband-hdr").bandwidth == 25e9
    assert link_preset("ib-ndr").bandwidth == 50e9
    assert link_preset("roce-400g").bandwidth == 50e9
    assert link_preset("ethernet-25g").bandwidth == 3.125e9
    with pytest.raises(ValueError, match="unknown interconnect 'warp'; choose from nvlink4"):
        link_preset("warp")


def test_guess_intra_node_from_the_gpu_name():
    assert guess_intra_node("NVIDIA H100 80GB HBM3") == "nvlink4"
    assert guess_intra_node("NVIDIA H100 PCIe") == "pcie4"
    assert guess_intra_node("NVIDIA A100-SXM4-80GB") == "nvlink3"
    assert guess_intra_node("NVIDIA GeForce RTX 4090") == "pcie4"


def test_resolve_links_presets_guesses_and_overrides():
    none = {"intra_node": None, "inter_node": None, "bandwidth": None, "latency": None,
            "inter_node_bandwidth": None, "inter_node_latency": None, "gpu_name": None}
    default = resolve_links(**none)  # as before presets: 10 Gbit/s, 50 us both ways
    assert (default.intra_bandwidth, default.intra_latency) == (1.25e9, 50e-6)
    assert (default.inter_bandwidth, default.inter_latency) == (1.25e9, 50e-6)
    guessed = resolve_links(**{**none, "gpu_name": "NVIDIA H100 80GB HBM3"})
    assert guessed.intra_bandwidth == 450e9 and "guessed" in guessed.intra_label
    assert guessed.inter_bandwidth == 1.25e9  # NVLink does not leave the node
    both = resolve_links(**{**none, "intra_node": "nvlink4", "inter_node": "infiniband-ndr",
                            "inter_node_bandwidth": 40e9})
    assert (both.intra_bandwidth, both.inter_bandwidth, both.inter_latency) == (450e9, 40e9, 14e-6)
    explicit = resolve_links(**{**none, "intra_node": "nvlink4", "bandwidth": 100e9})
    assert explicit.intra_bandwidth == 100e9 and explicit.intra_latency == 3.4e-6
    assert explicit.inter_bandwidth == 100e9  # --bandwidth alone still sets both, as before
    with pytest.raises(ValueError, match="^inter-node: nvlink4 links devices inside one node"):
        resolve_links(**{**none, "inter_node": "nvlink"})


# --- scaling tables -----------------------------------------------------------------


def test_parse_node_counts():
    assert parse_node_counts("1,2,4,8") == (1, 2, 4, 8)
    assert parse_node_counts(" 3 ") == (3,)
    for bad in ("", "1,x", "0,2", "2,2"):
        with pytest.raises(ValueError):
            parse_node_counts(bad)


@pytest.fixture
def hybrid_not_modelled(monkeypatch):
    """The table as it reads when a strategy has no cost model (hybrid stands in)."""
    entries = tuple(replace(e, cost_model="", not_modelled="its layout is not modelled yet")
                    if e.name == "hybrid" else e for e in table.STRATEGY_TABLE)
    monkeypatch.setattr(table, "STRATEGY_TABLE", entries)


def test_scaling_table_per_strategy_and_node_count(hybrid_not_modelled):
    hw = Hardware(intra_node_bandwidth=450e9, intra_node_latency=3.4e-6,
                  inter_node_bandwidth=1.25e9, inter_node_latency=50e-6, num_devices_per_node=8)
    reports = plan_scaling(profile(num_parameters=50_000_000), hw, (1, 2, 4),
                           batch_size_per_device=8, strategies=["single", "ddp", "hybrid"])
    assert [r.hardware.world_size for r in reports] == [8, 16, 32]
    ddp = [r.prediction("ddp") for r in reports]
    # A slow network between nodes: efficiency drops once traffic leaves the node.
    assert ddp[0].scaling_efficiency > ddp[1].scaling_efficiency > ddp[2].scaling_efficiency
    assert all(r.prediction("single").samples_per_second == reports[0].prediction(
        "single").samples_per_second for r in reports)
    lines = format_scaling(reports).splitlines()
    assert lines[0].split() == ["nodes", "devices", "single", "ddp", "hybrid*", "recommended"]
    assert lines[2].split()[:2] == ["1", "8"] and lines[4].split()[:2] == ["4", "32"]
    assert f"({ddp[2].scaling_efficiency:.0%})" in lines[4]
    assert lines[2].split()[-2] == "-"  # hybrid has no numbers
    assert "* not modelled" in lines[-1]


# --- strategies not modelled ---------------------------------------------------------


def test_not_modelled_is_listed_but_never_recommended(hybrid_not_modelled):
    hw = Hardware(num_devices_per_node=4, device_memory_bytes=8 * 10**9)
    report = plan(profile(), hw, batch_size_per_device=4, strategies=["hybrid"])
    assert report.recommendation == "" and "modelled" in report.reason
    row = report.prediction("hybrid")
    assert not row.modelled and row.fits is None and row.note == "its layout is not modelled yet"
    assert "hybrid (not modelled)" in report.format_table()
    full = plan(profile(), hw, batch_size_per_device=4)
    assert full.recommendation not in ("", "hybrid")
    assert [p.strategy for p in full.predictions if not p.modelled] == ["hybrid"]
    rows = json.loads(json.dumps(full.to_dict()))["predictions"]
    assert next(r for r in rows if r["strategy"] == "hybrid")["modelled"] is False


def test_hybrid_is_fsdp_within_a_node_and_replicates_across_nodes():
    one = Hardware(num_devices_per_node=4, intra_node_bandwidth=100e9)
    pr = profile(num_parameters=10_000_000)
    fsdp, hybrid = (predict(s, pr, one, batch_size_per_device=8) for s in ("fsdp", "hybrid"))
    assert hybrid.step_time == pytest.approx(fsdp.step_time)
    assert hybrid.memory_bytes == pytest.approx(fsdp.memory_bytes)
    two = replace(one, num_nodes=2, inter_node_bandwidth=1e9)
    fsdp, hybrid = (predict(s, pr, two, batch_size_per_device=8) for s in ("fsdp", "hybrid"))
    assert hybrid.num_devices == 8 and "shard 4 x replicate 2" in hybrid.note
    # State sharded over the node's 4 devices, not all 8; only gradient shards cross nodes.
    assert hybrid.param_memory == pytest.approx(40 * MB / 4)
    assert fsdp.param_memory == pytest.approx(40 * MB / 8)
    assert hybrid.comm_time < fsdp.comm_time


def test_mp_buys_memory_not_speed():
    hw = Hardware(num_devices_per_node=4, intra_node_bandwidth=1e9, intra_node_latency=0.0)
    pr = profile(num_parameters=1_000_000, activation_bytes_per_sample=8000.0)
    single = predict("single", pr, hw, batch_size_per_device=16)
    mp = predict("mp", pr, hw, batch_size_per_device=16)
    # Same batch through every layer in turn, plus 4 crossings of 1000 B/sample each way.
    assert mp.global_batch_size == 16 and mp.num_devices == 4
    assert mp.exposed_comm_time == pytest.approx(2 * 16 * 4 * 1000 / 1e9)
    assert mp.step_time == pytest.approx(single.step_time + mp.exposed_comm_time)
    assert mp.param_memory == pytest.approx(single.param_memory / 4)
    assert mp.scaling_efficiency < 0.25
    alone = predict("mp", pr, Hardware(num_devices_per_node=1), batch_size_per_device=16)
    assert alone.num_devices == 1 and "runs as single" in alone.note


# --- command line --------------------------------------------------------------------


def test_cli_uses_the_gpu_memory_and_guessed_nvlink(monkeypatch, capsys):
    fake_gpu(monkeypatch)
    argv = ["--num-parameters", "1000000", "--strategies", "ddp", "--json", "-"]
    assert main(argv) == 0
    hw = json.loads(capsys.readouterr().out)["hardware"]
    assert hw["device_memory_bytes"] == 80 * 2**30 and hw["intra_node_bandwidth"] == 450e9
    assert main([*argv, "--device", "cpu"]) == 0
    hw = json.loads(capsys.readouterr().out)["hardware"]
    assert hw["device_memory_bytes"] is None and hw["intra_node_bandwidth"] == 1.25e9


def test_cli_scaling_table(capsys):
    assert main(["--num-parameters", "10000000", "--nodes", "1,2", "--intra-node", "nvlink4",
                 "--inter-node", "roce-100g", "--strategies", "single,ddp,fsdp"]) == 0
    out = capsys.readouterr().out
    assert "1,2 node(s)" in out and "intra-node 450 GB/s" in out and "(roce-100g)" in out
    assert "recommended" in out
    assert main(["--num-parameters", "10000000", "--nodes", "1,2", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["nodes"] == [1, 2] and len(data["reports"]) == 2


@pytest.mark.parametrize(("argv", "flag"), [
    (["--nodes", "1,x"], "--nodes"),
    (["--nodes", "2,2"], "--nodes"),
    (["--intra-node", "warp"], "--intra-node"),
    (["--inter-node", "nvlink"], "--inter-node"),
    (["--precision", "fp8"], "--precision"),
    (["--device", "tpu"], "--device"),
    (["--semi-sync", "0"], "--semi-sync"),
    (["--semi-sync", "50"], "--semi-sync"),  # one node: no replica groups to sync
])
def test_cli_new_flags_fail_in_one_line(argv, flag, capsys):
    assert main(["--num-parameters", "1000", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err, err


def test_cli_device_cuda_without_a_gpu(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--device", "cuda", "--num-parameters", "1000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--device: 'cuda' requested" in err and "--device cpu" in err


# --- on a real GPU ---------------------------------------------------------------------




@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_calibration_is_synchronized_and_compute_heavy_children_show():
    # Big enough to be compute-bound on a GPU, where small layers only measure launches.
    model = nn.Sequential(nn.Linear(4096, 8192), nn.ReLU(), nn.Linear(8192, 8))
    pr = calibrate(model, torch.randn(4096, 4096), repeats=3, optimizer="adam")
    heavy, _, light = pr.chain_times
    assert heavy > 5 * light
    assert next(model.parameters()).device.type == "cpu"  # measured on a copy
    # 3 matmuls of 2*4096*4096*8192 FLOPs: over 0.8 TFLOP, so >= 1 ms even on an H200.
    assert pr.compute_time_per_sample * 4096 > 1e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "16-mixed"])
def test_gpu_calibration_in_each_precision(precision):
    from paratrain.plan import default_model

    pr = calibrate(default_model(), torch.randn(32, 1, 28, 28), precision=precision)
    assert 0 < pr.compute_time_per_sample < 1e-3
