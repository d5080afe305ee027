"""Tests of the analytic planner behind ``paratrain plan`` (hand-computed cases)."""

from __future__ import annotations

import json
import math

import pytest

from paratrain.plan import (
    STRATEGIES,
    Hardware,
    ModelProfile,
    allgather_time,
    allreduce_time,
    ddp_buckets,
    exposed_comm_time,
    format_bytes,
    format_seconds,
    parse_bandwidth,
    parse_duration,
    parse_size,
    plan,
    predict,
    ps_comm_time,
    reduce_scatter_time,
    ring_allgather_time,
    ring_allreduce_time,
    ring_reduce_scatter_time,
)

MB = 1e6


def profile(**kw):
    base = {"num_parameters": 1_000_000, "activation_bytes_per_sample": 1000.0,
            "compute_time_per_sample": 1e-3, "num_layers": 8}
    base.update(kw)
    return ModelProfile(**base)


def hardware(**kw):
    base = {"intra_node_bandwidth": 1e9, "inter_node_bandwidth": 1e9, "intra_node_latency": 0.0,
            "inter_node_latency": 0.0, "num_devices_per_node": 4}
    base.update(kw)
    return Hardware(**base)


# --- collectives ---------------------------------------------------------------


def test_ring_allreduce_100mb_4_ranks_1gbs():
    # 2 * 3/4 * 100 MB / 1 GB/s = 150 ms, plus 2 * 3 latency terms.
    assert ring_allreduce_time(100 * MB, 4, 1e9, 0.0) == pytest.approx(0.150)
    assert ring_allreduce_time(100 * MB, 4, 1e9, 1e-5) == pytest.approx(0.150 + 6e-5)
    assert ring_allreduce_time(100 * MB, 1, 1e9, 1e-5) == 0.0


def test_ring_allgather_and_reduce_scatter_are_half_an_allreduce():
    assert ring_allgather_time(100 * MB, 4, 1e9, 1e-5) == pytest.approx(0.075 + 3e-5)
    assert ring_reduce_scatter_time(100 * MB, 4, 1e9, 1e-5) == pytest.approx(0.075 + 3e-5)


def test_hierarchical_allreduce_two_nodes():
    hw = hardware(intra_node_bandwidth=10e9, inter_node_bandwidth=1e9, num_nodes=2)
    # intra reduce-scatter 7.5 ms + inter all-reduce of 25 MB over 2 nodes 25 ms + intra all-gather 7.5 ms
    assert allreduce_time(100 * MB, hw) == pytest.approx(0.0075 + 0.025 + 0.0075)
    # all-gather: inter-node of S/4 (12.5 ms) + intra-node of S (7.5 ms)
    assert allgather_time(100 * MB, hw) == pytest.approx(0.0125 + 0.0075)
    assert reduce_scatter_time(100 * MB, hw) == pytest.approx(0.0125 + 0.0075)


def test_hierarchical_equals_ring_on_one_node():
    hw = hardware(intra_node_latency=1e-5)
    assert allreduce_time(100 * MB, hw) == pytest.approx(ring_allreduce_time(100 * MB, 4, 1e9, 1e-5))


def test_ps_comm_time_and_traffic():
    # 4 workers, 2 servers: each server sends 4 parameter shards of 50 MB at once (200 MB
    # on its link), then receives 4 gradient shards of 50 MB: 400 MB -> 0.4 s at 1 GB/s.
    t = ps_comm_time(100 * MB, 100 * MB, num_workers=4, num_servers=2, bandwidth=1e9, latency=1e-4)
    assert t == pytest.approx(0.4 + 2e-4)
    # 1 server, fp32 gradients of bf16 parameters: 4 x 50 MB out, then 4 x 100 MB in.
    t = ps_comm_time(100 * MB, 50 * MB, num_workers=4, num_servers=1, bandwidth=1e9, latency=0.0)
    assert t == pytest.approx(0.6)
    # More servers than workers: each worker's own link (push + pull) is the slower end.
    t = ps_comm_time(100 * MB, 100 * MB, num_workers=2, num_servers=4, bandwidth=1e9, latency=0.0)
    assert t == pytest.approx(0.2)
    pr = profile(num_parameters=25_000_000)  # 100 MB of fp32 parameters and gradients
    p = predict("ps", pr, hardware(intra_node_latency=1e-4), batch_size_per_device=1, num_servers=2)
    assert p.comm_time == pytest.approx(0.4 + 2e-4)
    assert p.exposed_comm_time == p.comm_time  # synchronous: nothing hides
    assert p.traffic_bytes == pytest.approx(400 * MB)


def test_exposed_comm_overlap():
    assert exposed_comm_time(1.0, 0.6, overlap=1.0, tail=0.1) == pytest.approx(0.4)
    assert exposed_comm_time(1.0, 0.6, overlap=0.0, tail=0.1) == pytest.approx(1.0)
    assert exposed_comm_time(1.0, 10.0, tail=0.1) == pytest.approx(0.1)  # only the last bucket
    assert exposed_comm_time(0.05, 10.0, tail=0.1) == pytest.approx(0.05)


def test_ddp_buckets_follow_first_bucket_rule():
    mib = 1024 * 1024
    assert ddp_buckets(10 * mib, 10) == pytest.approx([1 * mib, 9 * mib])
    sizes = ddp_buckets(1000 * mib, 4)
    assert sum(sizes) == pytest.approx(1000 * mib)
    assert all(s <= 26 * mib for s in sizes)
    assert ddp_buckets(100.0, 1) == [100.0]


def test_ddp_small_model_exposes_its_single_bucket():
    pr = profile(num_parameters=1000, num_layers=1)  # 4 KB: one bucket, ready at the very end
    p = predict("ddp", pr, hardware(intra_node_latency=1e-5), batch_size_per_device=8)
    assert p.exposed_comm_time == pytest.approx(p.comm_time)
    assert p.step_time == pytest.approx(8e-3 + p.comm_time)


# --- strategies ----------------------------------------------------------------


def test_memory_per_strategy_n4():
    # 1M params: 4 MB params, 4 MB grads, 8 MB Adam state; 10 samples x 1000 B activations.
    report = plan(profile(), hardware(), batch_size_per_device=10)
    act = 10 * 1000
    expected = {
        "single": 16 * MB, "ddp": 16 * MB, "dp": 16 * MB,
        "ps": 8 * MB,  # optimizer lives on the servers
        "fsdp": 4 * MB,
        "pipeline": 4 * MB,  # 8 layers over 4 stages
        "mp": 4 * MB,  # 8 layers over the node's 4 devices
        "hybrid": 4 * MB,  # one node: sharded over its 4 devices, as fsdp
    }
    for name, state in expected.items():
        assert report.prediction(name).memory_bytes == pytest.approx(state + act), name


def test_pipeline_bubble_fraction():
    # p = 4 stages, m = 12 micro-batches: bubble (p-1)/(m+p-1) = 3/15; no comm cost at all.
    pr = profile(activation_bytes_per_sample=0.0)
    p = predict("pipeline", pr, hardware(intra_node_bandwidth=1e18), batch_size_per_device=12,
                num_microbatches=12)
    assert p.bubble_fraction == pytest.approx(0.2)
    assert p.global_batch_size == 48
    assert p.scaling_efficiency == pytest.approx(0.8)
    assert p.bubble_time / p.step_time == pytest.approx(0.2)


def test_pipeline_boundary_is_the_tensor_at_the_balanced_cut():
    # 4 children of 100/100/100/100 parameters, 2 stages: cut after child 2, whose output is
    # 50 bytes per sample. Batch 8 per device -> mini-batch 16, m = 4 -> 4 samples each.
    chain = ((100, 1000.0), (100, 50.0), (100, 2000.0), (100, 40.0))
    pr = profile(num_parameters=400, num_layers=4, chain=chain)
    p = predict("pipeline", pr, hardware(num_devices_per_node=2, intra_node_bandwidth=1e3),
                batch_size_per_device=8, num_microbatches=4)
    # m micro-batches, each one transfer forward and one backward of 4 x 50 bytes = 0.2 s.
    assert p.comm_time == pytest.approx(4 * 2 * 0.2)
    # Without the chain the boundary is the average a / L = 1000 / 4 bytes per sample.
    q = predict("pipeline", profile(num_parameters=400, num_layers=4),
                hardware(num_devices_per_node=2, intra_node_bandwidth=1e3),
                batch_size_per_device=8, num_microbatches=4)
    assert q.comm_time == pytest.approx(4 * 2 * 4 * 250 / 1e3)
    with pytest.raises(ValueError, match="chain"):
        profile(chain=((-1, 1.0),))


@pytest.mark.parametrize(("overlap", "step"), [
    # slot = 4 samples x 1 ms / 2 stages = 2 ms; one transfer t = 0.2 s (link-bound).
    # The first micro-batch: both stages and both transfers, 2 slot + 2t = 0.404 s. Then
    # m - 1 = 3 more micro-batches:
    (1.0, 0.404 + 3 * 0.2),          # sends hidden behind compute: max(slot, t) each
    (0.0, 0.404 + 3 * 0.402),        # nothing hidden: slot + 2t each
    (0.5, 0.404 + 3 * (0.1 + 0.201)),
])
def test_pipeline_step_overlaps_transfers_with_the_next_micro_batch(overlap, step):
    pr = profile(num_parameters=400, num_layers=4,
                 chain=((100, 1000.0), (100, 50.0), (100, 2000.0), (100, 40.0)))
    p = predict("pipeline", pr, hardware(num_devices_per_node=2, intra_node_bandwidth=1e3),
                batch_size_per_device=8, num_microbatches=4, overlap=overlap)
    assert p.step_time == pytest.approx(step)
    assert p.bubble_time == pytest.approx(0.002)
    assert p.exposed_comm_time == pytest.approx(step - 5 * 0.002)


def test_pipeline_compute_bound_hides_all_but_the_fill():
    # slot = 2 ms, t = 0.2 ms: only the first micro-batch's 2(p - 1) transfers show.
    pr = profile(num_parameters=400, num_layers=4,
                 chain=((100, 1000.0), (100, 50.0), (100, 2000.0), (100, 40.0)))
    p = predict("pipeline", pr, hardware(num_devices_per_node=2, intra_node_bandwidth=1e6),
                batch_size_per_device=8, num_microbatches=4)
    assert p.exposed_comm_time == pytest.approx(2 * 2e-4)
    assert p.step_time == pytest.approx(5 * 2e-3 + 4e-4)


def test_pipeline_slowest_stage_sets_the_pace():
    # Cut after child 2 (balanced parameters), but the first two children hold 4/5 of the
    # compute: per micro-batch of 4 samples (4 ms of work) stage 0 takes 3.2 ms, stage 1
    # 0.8 ms. No transfer cost. Step = both stages once + 3 x the slower = 13.6 ms; a
    # device's average work is 4 x 4 / 2 = 8 ms, the rest is idle (bubble and imbalance).
    pr = profile(num_parameters=400, num_layers=4,
                 chain=((100, 1000.0), (100, 50.0), (100, 2000.0), (100, 40.0)),
                 chain_times=(3e-4, 1e-4, 0.5e-4, 0.5e-4))
    p = predict("pipeline", pr, hardware(num_devices_per_node=2, intra_node_bandwidth=1e18),
                batch_size_per_device=8, num_microbatches=4)
    assert p.step_time == pytest.approx(13.6e-3)
    assert p.compute_time == pytest.approx(8e-3)
    assert p.bubble_time == pytest.approx(5.6e-3)
    assert p.bubble_fraction == pytest.approx(5.6 / 13.6)
    with pytest.raises(ValueError, match="chain_times must have one entry per chain entry"):
        profile(chain=((1, 1.0),), chain_times=(1.0, 2.0))


def test_pipeline_needs_enough_layers():
    p = predict("pipeline", profile(num_layers=2), hardware(), batch_size_per_device=4)
    assert not p.applicable
    report = plan(profile(num_layers=2), hardware(), batch_size_per_device=4)
    assert report.recommendation != "pipeline"


def test_scaling_efficiency_is_one_on_one_device():
    hw = hardware(num_devices_per_node=1, intra_node_latency=1e-4)
    report = plan(profile(), hw, batch_size_per_device=16, strategies=[
        "single", "ddp", "fsdp", "pipeline", "dp", "mp"])
    for p in report.predictions:
        assert p.scaling_efficiency == pytest.approx(1.0), p.strategy
    assert report.recommendation == "single"  # ties go to the simplest


def test_ddp_scales_perfectly_when_comm_hides():
    pr = profile(num_parameters=10_000, compute_time_per_sample=0.1)
    p = predict("ddp", pr, hardware(intra_node_bandwidth=1e12), batch_size_per_device=32)
    assert p.samples_per_second == pytest.approx(4 * 32 / 3.2, rel=1e-3)
    assert p.scaling_efficiency == pytest.approx(1.0, rel=1e-3)


def test_fsdp_moves_three_halves_of_ddp_traffic():
    pr = profile()
    hw = hardware()
    ddp = predict("ddp", pr, hw, batch_size_per_device=1)
    fsdp = predict("fsdp", pr, hw, batch_size_per_device=1)
    assert ddp.traffic_bytes == pytest.approx(2 * 3 / 4 * 4 * MB)
    assert fsdp.traffic_bytes == pytest.approx(3 * 3 / 4 * 4 * MB)


def test_activation_checkpointing_trades_memory_for_compute():
    plain = profile(backward_fraction=2 / 3)
    ckpt = profile(backward_fraction=2 / 3, activation_checkpointing=True)
    assert ckpt.stored_activation_bytes_per_sample == pytest.approx(1000 * 2 / 8)
    assert ckpt.step_compute_time_per_sample == pytest.approx(1e-3 * (1 + 1 / 3))
    a = predict("single", plain, hardware(), batch_size_per_device=10)
    b = predict("single", ckpt, hardware(), batch_size_per_device=10)
    assert b.activation_memory == pytest.approx(a.activation_memory / 4)
    assert b.step_time == pytest.approx(a.step_time * 4 / 3)


def test_recommendation_fits_memory_when_ddp_does_not():
    # 16 GB of model state, 8 GB devices: ddp and zero1 (4 + 4 + 8/4 GB) do not fit;
    # zero2 (4 + 12/4 GB) does: it gathers nothing in backward (less traffic than fsdp),
    # both hide their traffic here, and the simpler one wins the tie.
    pr = profile(num_parameters=1_000_000_000, num_layers=32, compute_time_per_sample=0.05)
    hw = hardware(device_memory_bytes=8 * 10**9, intra_node_bandwidth=100e9)
    report = plan(pr, hw, batch_size_per_device=4)
    assert report.prediction("ddp").fits is False and report.prediction("zero1").fits is False
    assert report.prediction("ddp").samples_per_second > report.prediction("fsdp").samples_per_second
    assert report.recommendation == "zero2"
    zero2, fsdp = report.prediction("zero2"), report.prediction("fsdp")
    assert zero2.comm_time < fsdp.comm_time and zero2.traffic_bytes < fsdp.traffic_bytes
    assert zero2.samples_per_second >= fsdp.samples_per_second
    assert report.prediction("fsdp").fits is True
    assert "fits in 8 GB" in report.reason and "faster ddp would not fit" in report.reason


def test_recommendation_without_memory_limit_and_when_nothing_fits():
    report = plan(profile(), hardware(), batch_size_per_device=4, strategies=["ddp", "fsdp"])
    assert all(p.fits is None for p in report.predictions)
    assert "not checked" in report.reason
    tiny = hardware(device_memory_bytes=1000)
    report = plan(profile(), tiny, batch_size_per_device=4, strategies=["ddp", "fsdp", "ps"])
    assert report.recommendation == "fsdp"  # least memory
    assert report.reason.startswith("No strategy fits")


def test_report_table_and_dict():
    report = plan(profile(), hardware(device_memory_bytes=10**9), batch_size_per_device=4)
    lines = report.format_table().splitlines()
    assert len(lines) == 2 + len(STRATEGIES)
    assert lines[0].startswith("strategy") and set(lines[1]) <= {"-", " "}
    col = lines[0].index("samples/s") + len("samples/s")  # right-aligned numbers end here
    assert all(line[col - 1].isdigit() for line in lines[2:])
    data = json.loads(json.dumps(report.to_dict()))
    assert [p["strategy"] for p in data["predictions"]] == list(STRATEGIES)
    assert data["recommendation"] == report.recommendation
    assert data["hardware"]["num_devices_per_node"] == 4


# --- validation ----------------------------------------------------------------


@pytest.mark.parametrize(("factory", "kwargs", "field"), [
    (Hardware, {"num_nodes": 0}, "num_nodes"),
    (Hardware, {"num_devices_per_node": 1.5}, "num_devices_per_node"),
    (Hardware, {"intra_node_bandwidth": 0}, "intra_node_bandwidth"),
    (Hardware, {"inter_node_latency": -1.0}, "inter_node_latency"),
    (Hardware, {"device_memory_bytes": 0}, "device_memory_bytes"),
    (profile, {"num_parameters": 0}, "num_parameters"),
    (profile, {"num_parameters": True}, "num_parameters"),
    (profile, {"compute_time_per_sample": 0.0}, "compute_time_per_sample"),
    (profile, {"activation_bytes_per_sample": math.nan}, "activation_bytes_per_sample"),
    (profile, {"backward_fraction": 1.5}, "backward_fraction"),
    (profile, {"num_layers": 0}, "num_layers"),
    (profile, {"activation_checkpointing": "yes"}, "activation_checkpointing"),
])
def test_dataclass_validation_names_the_field(factory, kwargs, field):
    with pytest.raises(ValueError, match=field):
        factory(**kwargs)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"batch_size_per_device": 0}, "batch_size_per_device"),
    ({"batch_size_per_device": 4, "strategies": ["ddp", "magic"]}, "strategies"),
    ({"batch_size_per_device": 4, "num_servers": 0}, "num_servers"),
    ({"batch_size_per_device": 4, "overlap": 1.5}, "overlap"),
    ({"batch_size_per_device": 1, "num_microbatches": 99}, "num_microbatches"),
])
def test_plan_validation_names_the_argument(kwargs, field):
    with pytest.raises(ValueError, match=field):
        plan(profile(), hardware(), **kwargs)


# --- units ---------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("10Gbit", 1.25e9), ("200Mbit", 25e6), ("10Gbps", 1.25e9), ("10 Gbit/s", 1.25e9),
    ("25GB", 25e9), ("1.5GB/s", 1.5e9), ("1GiB", 2**30), ("100Mb", 12.5e6), ("1e9", 1e9),
])
def test_parse_bandwidth(text, expected):
    assert parse_bandwidth(text) == pytest.approx(expected)


def test_parse_size_and_duration():
    assert parse_size("16GB") == 16 * 10**9
    assert parse_size("512MiB") == 512 * 2**20
    assert parse_size("8Gbit") == 10**9
    assert parse_size("1024") == 1024
    assert parse_duration("50us") == pytest.approx(50e-6)
    assert parse_duration("50µs") == pytest.approx(50e-6)
    assert parse_duration("1.5ms") == pytest.approx(1.5e-3)
    assert parse_duration("2s") == 2.0
    assert parse_duration("100ns") == pytest.approx(1e-7)
    assert parse_duration("0.01") == 0.01


@pytest.mark.parametrize("text", ["10G", "fast", "10Gx", "", "-5GB", "10GB/s/s"])
def test_parse_bandwidth_rejects(text):
    with pytest.raises(ValueError, match="cannot parse"):
        parse_bandwidth(text)


def test_parse_duration_rejects():
    for text in ("50 parsecs", "1ms/s", "ms"):
        with pytest.raises(ValueError, match="duration"):
            parse_duration(text)


def test_formatting():
    assert format_bytes(16e9) == "16 GB"
    assert format_bytes(1.25e9) == "1.25 GB"
    assert format_bytes(12) == "12 B"
    assert format_seconds(0.0123) == "12.3 ms"
    assert format_seconds(0) == "0"
