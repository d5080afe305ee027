"""Tests of hybrid's explicit layouts in the planner (pure arithmetic, no processes)."""

from __future__ import annotations

import json

import pytest

from paratrain.distributed.mesh import ParallelDegrees
from paratrain.plan import (
    Hardware,
    ModelProfile,
    exposed_comm_time,
    plan,
    predict,
    ring_allgather_time,
)
from paratrain.plan.cli import main
from paratrain.plan.costs import PlanOptions, _fsdp_tp, _tp
from paratrain.plan.layouts import (
    candidate_layouts,
    default_layout,
    group_hardware,
    layout_cost,
    parse_layout,
    resolve_layout,
)

GB = 1e9


def profile(**kw):
    base = {"num_parameters": 1_000_000, "activation_bytes_per_sample": 1000.0,
            "compute_time_per_sample": 1e-3, "num_layers": 8}
    base.update(kw)
    return ModelProfile(**base)


def hardware(**kw):
    # Different, non-zero links so a wrong link choice or a dropped latency term shows.
    base = {"intra_node_bandwidth": 2e9, "inter_node_bandwidth": 5e8, "intra_node_latency": 1e-5,
            "inter_node_latency": 4e-5, "num_devices_per_node": 4, "num_nodes": 2}
    base.update(kw)
    return Hardware(**base)


FIELDS = ("step_time", "compute_time", "comm_time", "exposed_comm_time", "bubble_time",
          "bubble_fraction", "traffic_bytes", "memory_bytes", "global_batch_size")


def assert_same(a, b, rel=1e-9):
    for name in FIELDS:
        assert getattr(a, name) == pytest.approx(getattr(b, name), rel=rel, abs=1e-15), name


# --- degenerate corners: the layout cost is the existing model there -------------


@pytest.mark.parametrize("chain", [False, True])
def test_all_pipeline_is_the_pipeline_strategy(chain):
    kw = {}
    if chain:  # unequal stages and crossing tensors: the cut logic must be shared too
        kw = {"chain": tuple((100 * (i % 3 + 1), 500.0 * (i + 1)) for i in range(8)),
              "chain_times": tuple(float(i + 1) for i in range(8))}
    pr, hw = profile(**kw), hardware()
    layout = predict("hybrid", pr, hw, batch_size_per_device=6, layout={"pipeline_degree": 8})
    assert layout.layout == {"pipeline_degree": 8, "replicate_degree": 1, "shard_degree": 1,
                             "tensor_degree": 1}
    assert_same(layout, predict("pipeline", pr, hw, batch_size_per_device=6))
    assert layout.bubble_time > 0 and layout.exposed_comm_time > 0


@pytest.mark.parametrize("seconds", [1e-3, 1.0])  # communication-bound, then hidden
def test_all_shard_is_fsdp_across_nodes(seconds):
    pr, hw = profile(compute_time_per_sample=seconds), hardware()
    layout = predict("hybrid", pr, hw, batch_size_per_device=4, layout=ParallelDegrees(shard_degree=8))
    assert_same(layout, predict("fsdp", pr, hw, batch_size_per_device=4))


@pytest.mark.parametrize("seconds", [1e-3, 1.0])
def test_the_default_layout_given_explicitly_is_the_default_hsdp(seconds):
    pr, hw = profile(compute_time_per_sample=seconds), hardware()
    given = predict("hybrid", pr, hw, batch_size_per_device=4, layout=default_layout(hw))
    default = predict("hybrid", pr, hw, batch_size_per_device=4)
    assert_same(given, default)
    assert default.layout == given.layout == {"pipeline_degree": 1, "replicate_degree": 2,
                                              "shard_degree": 4, "tensor_degree": 1}


@pytest.mark.parametrize("measured", [{}, {
    # A calibrated profile: part of the work and parameters stays whole on every tensor
    # rank, DTensor costs a fixed time per step, the all-reduces were counted.
    "tp_split_fraction": 0.8, "tp_split_param_fraction": 0.7, "tp_dispatch_time": 0.05,
    "tp_allreduces": 12, "tp_allreduce_bytes_per_sample": 3000.0}], ids=["estimated", "calibrated"])
def test_tensor_only_is_tp_and_shard_x_tensor_is_fsdp_tp_but_not_runnable(measured):
    # hybrid refuses tensor > 1 without a pipeline; the cost still reduces to tp / fsdp_tp.
    pr, o = profile(compute_time_per_sample=1.0, **measured), PlanOptions()  # FSDP hides
    one = hardware(num_nodes=1)
    for hw, degrees, reference in [
        (one, ParallelDegrees(tensor_degree=4), _tp),
        (one, ParallelDegrees(shard_degree=2, tensor_degree=2), _fsdp_tp),
    ]:
        got, want = layout_cost(pr, hw, 4, o, degrees), reference(pr, hw, 4, o)
        for name in ("compute", "comm", "exposed", "traffic", "batch", "optimizer_divisor"):
            assert getattr(got, name) == pytest.approx(getattr(want, name)), name
        assert not got.applicable and "needs a pipeline" in got.note


def test_stage_split_by_tensor_pays_its_all_reduces_in_every_slot():
    pr, hw = profile(activation_bytes_per_sample=1e6), hardware(num_nodes=1)
    pp = predict("hybrid", pr, hw, batch_size_per_device=4, layout={"pipeline_degree": 2,
                                                                     "replicate_degree": 2})
    pp_tp = predict("hybrid", pr, hw, batch_size_per_device=4,
                    layout={"pipeline_degree": 2, "tensor_degree": 2})
    assert pp_tp.compute_time == pytest.approx(pp.compute_time / 2)  # same mini-batch, half each
    # 4 all-reduces per block, 4 blocks per stage, 8 micro-batches of 1 sample (125 KB).
    tp_ar = 2 * (1 / 2) * 125e3 / 2e9 + 2 * 1e-5
    assert pp_tp.comm_time - 2 * 8 * (1e-5 + 125e3 / 2e9) == pytest.approx(8 * 4 * 4 * tp_ar)
    # Nothing hides them: every one of the p + m - 1 slots on the critical path pays them.
    assert pp_tp.exposed_comm_time >= (2 + 8 - 1) * 4 * 4 * tp_ar


def test_pipeline_x_fsdp_gathers_each_micro_batch_and_reduces_after_the_last():
    # 2 stages x 2 shards on one node, m = 4 micro-batches of 2 samples; a stage holds 4
    # of the 8 layers. Per micro-batch a stage gathers its layers (hidden behind its
    # forward but the first), and the reduce-scatters wait for the step's end.
    pr, hw = profile(), hardware(num_nodes=1)
    got = predict("hybrid", pr, hw, batch_size_per_device=4, num_microbatches=4,
                  layout={"pipeline_degree": 2, "shard_degree": 2})
    ag = ring_allgather_time(4e6 / 8, 2, 2e9, 1e-5)  # = the reduce-scatter of one layer
    work = 2 * 1e-3 / 2  # one micro-batch's forward + backward on one stage
    slot = work + exposed_comm_time(4 * ag, work / 3, tail=ag)
    p2p = 1e-5 + 2 * 1000 / 8 / 2e9
    assert got.comm_time == pytest.approx(2 * 4 * p2p + 4 * 4 * ag + 4 * ag)
    assert got.step_time == pytest.approx(2 * slot + 2 * p2p + 3 * slot + 4 * ag)
    assert got.note.endswith("m=4")


# --- memory and placement ----------------------------------------------------------


@pytest.mark.parametrize(("degrees", "divisor"), [
    ((1, 8, 1, 1), 1), ((2, 4, 1, 1), 2), ((2, 2, 2, 1), 4), ((2, 1, 2, 2), 8), ((1, 2, 4, 1), 4),
    ((4, 1, 1, 2), 8),
])
def test_memory_falls_by_pipeline_x_shard_x_tensor(degrees, divisor):
    pr, hw = profile(activation_bytes_per_sample=0.0), hardware()
    p, r, s, t = degrees
    got = predict("hybrid", pr, hw, batch_size_per_device=4, layout=ParallelDegrees(
        pipeline_degree=p, replicate_degree=r, shard_degree=s, tensor_degree=t))
    assert got.memory_bytes == pytest.approx(16e6 / divisor)  # 4 + 4 + 8 MB over the sharding


def test_tensor_ranks_keep_the_replicated_layers_whole():
    # A quarter of the parameters (embeddings, norms, head) stays whole on every tensor
    # rank: t = 4 holds 0.75 / 4 + 0.25 of the state, then FSDP / stages divide that.
    pr = profile(activation_bytes_per_sample=0.0, tp_split_param_fraction=0.75)
    held = 0.75 / 4 + 0.25
    one_node = hardware(num_nodes=1, num_devices_per_node=4)
    assert predict("tp", pr, one_node, batch_size_per_device=4).memory_bytes == pytest.approx(
        16e6 * held)
    held = 0.75 / 2 + 0.25
    assert predict("fsdp_tp", pr, one_node, batch_size_per_device=4).memory_bytes == \
        pytest.approx(16e6 * held / 2)
    got = predict("hybrid", pr, hardware(), batch_size_per_device=4, layout=ParallelDegrees(
        pipeline_degree=2, replicate_degree=1, shard_degree=2, tensor_degree=2))
    assert got.memory_bytes == pytest.approx(16e6 * held / 4)


def test_groups_use_the_links_their_axis_crosses():
    hw = hardware()  # 2 nodes x 4
    assert (group_hardware(hw, size=2, stride=2).num_nodes, group_hardware(hw, size=2, stride=2)
            .num_devices_per_node) == (1, 2)  # shard inside a node, tensor 2 inside it
    spread = group_hardware(hw, size=4, stride=2)  # 2 per node over both nodes
    assert (spread.num_devices_per_node, spread.num_nodes) == (2, 2)
    apart = group_hardware(hw, size=2, stride=4)  # replicas one node apart
    assert (apart.num_devices_per_node, apart.num_nodes) == (1, 2)
    uneven = group_hardware(Hardware(num_devices_per_node=6, num_nodes=2, inter_node_bandwidth=1e8),
                            size=4, stride=2)  # ranks 0,2,4,6: three on node 0, one on node 1
    assert uneven.num_nodes == 1 and uneven.intra_node_bandwidth == 1e8
    # Pipeline x FSDP: the shards inside a node gather at the fast link; as a replicate
    # axis of the same size, the gradients cross the slow one.
    pr = profile()
    inside = predict("hybrid", pr, hw, batch_size_per_device=4,
                     layout={"pipeline_degree": 2, "shard_degree": 4})
    outside = predict("hybrid", pr, hw, batch_size_per_device=4,
                      layout={"pipeline_degree": 2, "replicate_degree": 4})
    assert "shard 4" in inside.note and inside.memory_bytes < outside.memory_bytes


def test_candidate_layouts_are_runnable_and_bounded():
    hw = hardware(num_nodes=4)  # 16 devices
    found = candidate_layouts(hw, num_layers=4)
    assert default_layout(hw) in found and len(set(found)) == len(found)
    for d in found:
        assert d.world_size == 16 and 4 % d.tensor_degree == 0 and d.pipeline_degree <= 4
        assert d.tensor_degree == 1 or d.pipeline_degree > 1
    # One split axis first (the most sharded first: less memory on a tie), then more axes.
    assert found[0] == ParallelDegrees(shard_degree=16)
    assert found[-1].shape.count(1) < found[0].shape.count(1)
    assert ParallelDegrees(pipeline_degree=2, shard_degree=2, tensor_degree=4) in found


# --- bad layouts -------------------------------------------------------------------


@pytest.mark.parametrize(("layout", "message"), [
    ({"pipeline_degree": 3}, "pipeline_degree=3 does not divide the world size 8"),
    ({"pipeline_degree": 0}, "pipeline_degree must be an integer >= 1"),
    ({"tensor_degree": 2}, "tensor_degree=2 needs pipeline_degree > 1"),
    ({"pipline_degree": 2}, "unknown degree"),
    (ParallelDegrees(pipeline_degree=2, shard_degree=2), "the product of the degrees"),
    ({"pipeline_degree": 2, "shard_degree": 8}, "replicate_degree cannot be inferred"),
    ("pp=2", "must be a ParallelDegrees or a mapping"),
])
def test_bad_layouts_are_one_line_value_errors(layout, message):
    with pytest.raises(ValueError, match=message) as info:
        predict("hybrid", profile(), hardware(), batch_size_per_device=4, layout=layout)
    assert "\n" not in str(info.value)


def test_layout_is_for_hybrid_only_and_resolves_as_the_runtime():
    with pytest.raises(ValueError, match="hybrid' only"):
        predict("fsdp", profile(), hardware(), batch_size_per_device=4, layout={"shard_degree": 8})
    hw = hardware()
    assert resolve_layout({}, hw) == default_layout(hw)
    assert resolve_layout({"pipeline_degree": 2}, hw).shape == (2, 4, 1, 1, 1)


def test_parse_layout():
    assert parse_layout("pp=2,dp_shard=2,tp=2") == {"pipeline_degree": 2, "shard_degree": 2,
                                                    "tensor_degree": 2}
    assert parse_layout(" PP = 4 , dp_replicate=2") == {"pipeline_degree": 4, "replicate_degree": 2}
    for bad, message in [("pp", "NAME=N"), ("pp=2,zz=1", "unknown degree 'zz'"),
                         ("tp=2,tp=2", "given twice"), ("pp=0", "positive"), ("pp=x", "positive")]:
        with pytest.raises(ValueError, match=message):
            parse_layout(bad)


# --- CLI ----------------------------------------------------------------------------

ARGS = ["--num-parameters", "1000000", "--layers", "8", "--time-per-sample", "1ms",
        "--activation-bytes", "1000", "--devices-per-node", "4", "--nodes", "2", "--device", "cpu"]


def test_cli_costs_the_given_layout(capsys):
    assert main([*ARGS, "--layout", "pp=2,dp_shard=2,tp=2", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    row = next(p for p in data["predictions"] if p["strategy"] == "hybrid")
    assert row["layout"] == {"pipeline_degree": 2, "replicate_degree": 1, "shard_degree": 2,
                             "tensor_degree": 2}
    assert row["note"].startswith("pipeline 2 x replicate 1 x shard 2 x tensor 2, m=")
    assert data["settings"]["layout"] == {"pipeline_degree": 2, "shard_degree": 2,
                                          "tensor_degree": 2}
    assert data["settings"]["search_layouts"] is False


@pytest.mark.parametrize("argv", [
    ["--layout", "pp=3"], ["--layout", "pp"], ["--layout", "tp=2"], ["--layout", "qq=2"],
    ["--layout", "pp=2", "--strategies", "ddp,fsdp"],
])
def test_cli_rejects_bad_layouts_in_one_line(argv, capsys):
    assert main([*ARGS, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--layout" in err, err


# --- recommendation -------------------------------------------------------------------


def test_pipeline_x_fsdp_is_recommended_when_only_full_sharding_fits_and_nodes_are_slow():
    # 2B parameters (32 GB of state) on 4 nodes x 8, 1.5 GB per device: only layouts that
    # shard the state 32 ways fit. fsdp does, but gathers every layer over the slow
    # inter-node link; the default HSDP (8 ways) does not fit; pipeline x FSDP keeps the
    # gathers inside a node and sends only small activations between nodes.
    pr = ModelProfile(num_parameters=2_000_000_000, num_layers=8, activation_bytes_per_sample=200e6,
                      compute_time_per_sample=0.05)
    hw = Hardware(intra_node_bandwidth=100 * GB, inter_node_bandwidth=1.25 * GB,
                  intra_node_latency=5e-6, inter_node_latency=20e-6, num_devices_per_node=8,
                  num_nodes=4, device_memory_bytes=int(1.5 * GB))
    report = plan(pr, hw, batch_size_per_device=2)
    hybrid, fsdp = report.prediction("hybrid"), report.prediction("fsdp")
    assert report.recommendation == "hybrid"
    assert hybrid.layout == {"pipeline_degree": 4, "replicate_degree": 1, "shard_degree": 8,
                             "tensor_degree": 1}
    assert hybrid.note.startswith("pipeline 4 x replicate 1 x shard 8 x tensor 1")
    assert fsdp.fits and hybrid.fits and hybrid.samples_per_second > 3 * fsdp.samples_per_second
    assert predict("hybrid", pr, hw, batch_size_per_device=2).fits is False
    assert not report.prediction("pipeline").applicable  # 8 layers, 32 devices
    # Without the search hybrid is its default layout again, and fsdp is recommended.
    fixed = plan(pr, hw, batch_size_per_device=2, search_layouts=False)
    assert fixed.recommendation != "hybrid" and fixed.prediction("hybrid").fits is False
