"""The planner's ``tp`` / ``fsdp_tp`` costs and the ``tp_*`` profile fields behind them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from paratrain.models import GPT
from paratrain.plan import Hardware, ModelProfile, calibrate, predict, ring_allreduce_time
from paratrain.plan.tensor import tensor_parallel_fields

GB = 1e9


def profile(**kw):
    base = {"num_parameters": 1_000_000, "activation_bytes_per_sample": 8000.0,
            "compute_time_per_sample": 1e-3, "num_layers": 8, "backward_fraction": 0.5}
    return ModelProfile(**{**base, **kw})


def two_devices():
    return Hardware(num_devices_per_node=2, intra_node_bandwidth=GB, intra_node_latency=1e-4)


def tiny_gpt(n_layer=2):
    return GPT(vocab_size=32, block_size=8, n_layer=n_layer, n_head=2, n_embd=16)


def test_tp_without_measured_fields_keeps_the_old_estimate():
    # 4 all-reduces per layer of b a / L bytes, every parameter and all compute split.
    p = predict("tp", profile(), two_devices(), batch_size_per_device=4)
    comm = 4 * 8 * ring_allreduce_time(4 * 8000 / 8, 2, GB, 1e-4)
    assert p.exposed_comm_time == pytest.approx(comm)
    assert p.compute_time == pytest.approx(4 * 1e-3 / 2)


def test_tp_with_unknown_activation_traffic_is_not_ranked_and_names_the_flag(capsys):
    # `paratrain plan --num-parameters 1000000000` over 10 GbE: no activation bytes, so
    # tp's all-reduces would be costed at 0 bytes and tp recommended at 98% efficiency.
    from paratrain.distributed.mesh import ParallelDegrees
    from paratrain.plan.cli import main

    assert main(["--num-parameters", "1000000000", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    rows = {p["strategy"]: p for p in data["predictions"]}
    for name in ("tp", "fsdp_tp"):
        assert not rows[name]["applicable"], rows[name]
        assert rows[name]["note"].startswith("not ranked: tensor-parallel traffic unknown")
        assert "--activation-bytes" in rows[name]["note"]
    assert data["recommendation"] not in ("tp", "fsdp_tp")
    assert main(["--num-parameters", "1000000000"]) == 0
    printed = capsys.readouterr().out
    line = next(x for x in printed.splitlines() if x.startswith("tp "))
    assert "98%" not in line and "pass --activation-bytes" in line
    # Nor may hybrid's layout search pick a tensor degree; with activation bytes given
    # (or measured all-reduces), tp is costed as before.
    bare = profile(activation_bytes_per_sample=0.0)
    layout = ParallelDegrees(pipeline_degree=2, tensor_degree=2)
    assert not predict("hybrid", bare, Hardware(num_devices_per_node=4), batch_size_per_device=4,
                       layout=layout).applicable
    assert predict("tp", profile(), two_devices(), batch_size_per_device=4).applicable
    assert predict("tp", profile(activation_bytes_per_sample=0.0, tp_allreduces=4,
                                 tp_allreduce_bytes_per_sample=100.0), two_devices(),
                   batch_size_per_device=4).applicable


def test_tp_uses_the_measured_allreduces_and_the_replicated_share():
    pr = profile(tp_allreduces=12, tp_allreduce_bytes_per_sample=12 * 500.0,
                 tp_split_fraction=0.9)
    p = predict("tp", pr, two_devices(), batch_size_per_device=4)
    assert p.exposed_comm_time == pytest.approx(12 * ring_allreduce_time(4 * 500, 2, GB, 1e-4))
    assert p.traffic_bytes == pytest.approx(12 * 4 * 500)  # 2 (t-1)/t = 1 at t = 2
    assert p.compute_time == pytest.approx(4 * 1e-3 * (0.9 / 2 + 0.1))
    assert p.step_time == pytest.approx(p.compute_time + p.exposed_comm_time)


def test_fsdp_tp_gathers_each_tensor_ranks_part_replicated_parameters_included():
    hw = Hardware(num_devices_per_node=4, intra_node_bandwidth=GB, intra_node_latency=0.0)
    split = predict("fsdp_tp", profile(tp_split_param_fraction=0.5), hw,
                    batch_size_per_device=4)
    whole = predict("fsdp_tp", profile(), hw, batch_size_per_device=4)
    # A tensor rank holds 1/2 of the split half and all of the other: 3/4, not 1/2.
    tp_traffic = 4 * 8 * 4 * 8000 / 8  # the fallback's all-reduces, the same in both
    assert split.traffic_bytes - tp_traffic == pytest.approx(
        1.5 * (whole.traffic_bytes - tp_traffic))


def test_dispatch_is_a_fixed_cost_per_step_of_a_split_model_only():
    pr = profile(tp_dispatch_time=0.05)
    for batch in (1, 8):
        with_dispatch = predict("tp", pr, two_devices(), batch_size_per_device=batch)
        without = predict("tp", profile(), two_devices(), batch_size_per_device=batch)
        assert with_dispatch.compute_time == pytest.approx(without.compute_time + 0.05)
    hw4 = Hardware(num_devices_per_node=4, intra_node_bandwidth=GB)
    assert predict("fsdp_tp", pr, hw4, batch_size_per_device=2).compute_time == pytest.approx(
        predict("fsdp_tp", profile(), hw4, batch_size_per_device=2).compute_time + 0.05)
    one = predict("tp", pr, Hardware(), batch_size_per_device=2)
    assert one.compute_time == pytest.approx(2 * 1e-3)


@pytest.mark.parametrize(("field", "value"), [
    ("tp_allreduces", -1), ("tp_allreduces", True), ("tp_allreduce_bytes_per_sample", -1.0),
    ("tp_split_fraction", 1.5), ("tp_split_param_fraction", -0.1), ("tp_dispatch_time", -1e-3)])
def test_profile_validates_the_tp_fields(field, value):
    with pytest.raises(ValueError, match=field):
        profile(**{field: value})


def test_fields_count_one_allreduce_per_planned_layer_of_the_hidden_state():
    model = tiny_gpt(n_layer=2)
    tokens = torch.randint(32, (3, 8))
    fields = tensor_parallel_fields(model, lambda: model(tokens).sum(), batch=3,
                                    now=time.perf_counter)
    # Per block: q, k, v, fc backward and attn.proj, mlp.proj forward, each (8 tokens x 16) floats.
    assert fields["tp_allreduces"] == 12
    assert fields["tp_allreduce_bytes_per_sample"] == 12 * 8 * 16 * 4
    block_linears = 2 * (4 * (16 * 16 + 16) + (16 * 64 + 64) + (64 * 16 + 16))
    total = sum(p.numel() for p in model.parameters())
    assert fields["tp_split_param_fraction"] == pytest.approx(block_linears / total)
    assert 0 < fields["tp_split_fraction"] <= 1


def test_calibrate_fills_the_fields_only_for_splittable_models():
    model = tiny_gpt()
    tokens = torch.randint(32, (2, 8))
    targets = torch.randint(32, (2, 8))
    pr = calibrate(model, tokens, lambda out: F.cross_entropy(out.reshape(-1, 32),
                                                              targets.reshape(-1)), repeats=1,
                   warmup=1, device="cpu")
    assert pr.tp_allreduces == 12 and 0 < pr.tp_split_fraction <= 1
    plain = calibrate(torch.nn.Sequential(torch.nn.Linear(4, 4)), torch.randn(2, 4),
                      repeats=1, warmup=1, device="cpu")
    assert (plain.tp_allreduces, plain.tp_split_fraction) == (0, 1.0)


COUNT_COLLECTIVES = """
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from paratrain.models import GPT
from paratrain.strategies.tensor.plan import automatic_plan
from paratrain.strategies.tensor.apply import apply_tensor_parallel as apply_tp
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
model = GPT(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
apply_tp(model, init_device_mesh("cpu", (2,)), automatic_plan(model))
with CommDebugMode() as comm:
    model(torch.randint(32, (3, 8))).sum().backward()
print(sum(comm.get_comm_counts().values()))
"""


@pytest.mark.slow
def test_the_count_is_what_the_runtime_all_reduces():
    # Ground truth: the collectives DTensor issues for one forward + backward of the split
    # model (a fake process group, one process).
    out = subprocess.run([sys.executable, "-c", COUNT_COLLECTIVES], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    model = tiny_gpt(n_layer=2)
    fields = tensor_parallel_fields(model, lambda: model(torch.randint(32, (3, 8))).sum(),
                                    batch=3, now=time.perf_counter)
    assert int(out.stdout.split()[-1]) == fields["tp_allreduces"]
