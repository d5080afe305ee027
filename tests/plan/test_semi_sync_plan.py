"""``paratrain plan``'s semi-synchronous rows (``paratrain.plan.semi_sync``): bytes every
H steps, fragments, overlap, the outer state's memory, and when they are recommended."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from paratrain.distributed.mesh import ParallelDegrees
from paratrain.parallel.options import DiLoCo, LocalSGD
from paratrain.plan import Hardware, ModelProfile, plan, predict
from paratrain.plan.cli import main
from paratrain.plan.comm import ring_allreduce_time
from paratrain.plan.links import link_preset
from paratrain.plan.semi_sync import (
    CAVEAT,
    MARGIN,
    candidate_modes,
    link_is_slow,
    mode_label,
    plan_semi_sync,
    semi_sync_row,
)

# GPT-2 small: 124M parameters, 12 blocks, a 1024-token sequence in ~20 ms fwd+bwd.
GPT2 = ModelProfile(num_parameters=124_439_808, num_layers=12, compute_time_per_sample=20e-3,
                    activation_bytes_per_sample=300e6)
CLI_GPT2 = ["--num-parameters", "124439808", "--layers", "12", "--time-per-sample", "20ms",
            "--activation-bytes", "300MB", "--nodes", "2", "--devices-per-node", "8",
            "--intra-node", "nvlink4", "--batch-size", "8", "--device-memory", "80GB"]


def cluster(inter: str, *, nodes: int = 2, per_node: int = 8) -> Hardware:
    a, e = link_preset("nvlink4"), link_preset(inter)
    return Hardware(intra_node_bandwidth=a.bandwidth, intra_node_latency=a.latency,
                    inter_node_bandwidth=e.bandwidth, inter_node_latency=e.latency,
                    num_devices_per_node=per_node, num_nodes=nodes,
                    device_memory_bytes=80 * 10**9)


SLOW = cluster("ethernet-1g")


def row(mode, hw=SLOW, profile=GPT2, **kwargs):
    return semi_sync_row(profile, hw, mode, batch_size_per_device=8, **kwargs)


def test_bytes_per_step_scale_as_one_over_h_and_halve_with_bf16():
    shard_bytes = GPT2.num_parameters / 8 * 4  # fp32 parameters, FSDP over a node's 8
    for h in (10, 50, 100):
        for mode in (LocalSGD(every=h), DiLoCo(every=h)):
            r = row(mode)
            assert r.bytes_per_step == pytest.approx(shard_bytes / h)
            assert r.payload == pytest.approx(shard_bytes) and r.sync_every == h
            # A ring over 2 replicas sends what it all-reduces: 2 (R-1)/R = 1.
            assert r.traffic == pytest.approx(shard_bytes / h)
        half = row(DiLoCo(every=h, comm_dtype="bf16"))
        assert half.bytes_per_step == pytest.approx(shard_bytes / h / 2)
    # Parameters already in 2 bytes: bf16 sends as many bytes as they are.
    bf16_params = replace(GPT2, param_bytes=2, grad_bytes=2)
    assert (row(DiLoCo(every=10, comm_dtype="bf16"), profile=bf16_params).payload
            == row(DiLoCo(every=10), profile=bf16_params).payload)


def test_int8_is_gathered_not_summed_so_its_bytes_grow_with_the_groups():
    shard = GPT2.num_parameters / 8  # parameters of a rank's local shard
    int8 = row(DiLoCo(every=10, comm_dtype="int8"))
    assert int8.payload == pytest.approx(shard)  # 1 byte per parameter, R = 2
    # A ring all-gather sends (R - 1) messages; an all-reduce 2 (R - 1) / R payloads:
    # at R = 2 half of bf16's bytes, a quarter of float32's ...
    assert int8.traffic == pytest.approx(shard / 10)
    assert int8.traffic == pytest.approx(row(DiLoCo(every=10, comm_dtype="bf16")).traffic / 2)
    assert int8.traffic == pytest.approx(row(DiLoCo(every=10)).traffic / 4)
    # ... as many as bf16 at R = 4 and as float32 at R = 8.
    for groups, other in ((4, "bf16"), (8, None)):
        hw = cluster("ethernet-1g", nodes=groups)
        gathered = row(DiLoCo(every=10, comm_dtype="int8"), hw=hw)
        assert gathered.traffic == pytest.approx((groups - 1) * shard / 10)
        assert gathered.traffic == pytest.approx(
            row(DiLoCo(every=10, comm_dtype=other), hw=hw).traffic)
    # The gathered messages are held beside the sent one.
    assert int8.outer_memory == pytest.approx(3 * shard + 2 * shard * 4)


def test_fragments_spread_the_same_bytes_over_more_smaller_syncs():
    whole = row(DiLoCo(every=50))
    for k in (2, 5, 10):
        streamed = row(DiLoCo(every=50, fragments=k))
        assert streamed.bytes_per_step == pytest.approx(whole.bytes_per_step)
        assert streamed.traffic == pytest.approx(whole.traffic)
        assert streamed.payload == pytest.approx(whole.payload / k)
        assert streamed.sync_every == 50 // k
        assert streamed.sync_time < whole.sync_time
    # The sync is one all-reduce over the 2 nodes on the inter-node link (one port per rank).
    e = link_preset("ethernet-1g")
    assert whole.sync_time == pytest.approx(ring_allreduce_time(whole.payload, 2, e.bandwidth,
                                                                e.latency))
    assert whole.exposed_per_step == pytest.approx(whole.sync_time / 50)


def test_overlap_hides_the_sync_up_to_one_inner_step():
    # 5 fragments of GPT-2 over 1 Gbit/s: ~100 ms per sync, less than the 160 ms inner step.
    hidden = row(DiLoCo(every=50, fragments=5, overlap=True))
    assert hidden.sync_time < hidden.inner.compute_time
    assert hidden.exposed_per_sync == 0 and hidden.step_time == hidden.inner.step_time
    shown = row(DiLoCo(every=50, fragments=5))
    assert shown.exposed_per_sync == pytest.approx(shown.sync_time)
    assert shown.step_time == pytest.approx(shown.inner.step_time + shown.sync_time / 10)
    # One fragment (~500 ms) is longer than a step: only one inner step's compute hides.
    long = row(DiLoCo(every=50, overlap=True))
    assert long.sync_time > long.inner.compute_time
    assert long.exposed_per_sync == pytest.approx(long.sync_time - long.inner.compute_time)
    assert long.exposed_per_step == pytest.approx(long.exposed_per_sync / 50)
    # --overlap scales the window as it does for the synchronous strategies.
    half = row(DiLoCo(every=50, overlap=True), overlap=0.5)
    assert half.exposed_per_sync == pytest.approx(half.sync_time - 0.5 * half.inner.compute_time)
    # LocalSGD has no overlap: it always waits.
    assert row(LocalSGD(every=50)).exposed_per_sync == pytest.approx(
        row(DiLoCo(every=50)).sync_time)


def test_inner_step_is_hybrid_sharded_over_one_node():
    r = row(LocalSGD(every=10))
    inner = predict("hybrid", GPT2, replace(SLOW, num_nodes=1), batch_size_per_device=8,
                    layout=ParallelDegrees(shard_degree=8))
    assert r.inner.step_time == pytest.approx(inner.step_time)
    assert r.inner.memory_bytes == pytest.approx(inner.memory_bytes)
    assert r.samples_per_second == pytest.approx(2 * 8 * 8 / r.step_time)
    assert r.label == "Parallel(dp_replicate=2, dp_shard=8, semi_sync=LocalSGD(every=10))"


def test_memory_adds_the_sent_copy_and_diloco_snapshot_and_momentum():
    shard = GPT2.num_parameters / 8 * 4
    local = row(LocalSGD(every=50))
    assert local.outer_memory == pytest.approx(shard)  # the flat copy averaged at a sync
    diloco = row(DiLoCo(every=50))
    assert diloco.outer_memory == pytest.approx(3 * shard)  # + snapshot + momentum
    streamed = row(DiLoCo(every=50, fragments=10, comm_dtype="bf16"))
    assert streamed.outer_memory == pytest.approx(2 * shard + shard / 2 / 10)
    for r in (local, diloco, streamed):
        assert r.memory_bytes == pytest.approx(r.inner.memory_bytes + r.outer_memory)
    tight = replace(SLOW, device_memory_bytes=int(diloco.inner.memory_bytes + shard))
    assert row(LocalSGD(every=50), hw=tight).fits is True
    assert row(DiLoCo(every=50), hw=tight).fits is False


def test_candidates_and_refusals():
    labels = [mode_label(m) for m in candidate_modes((1, 50), num_layers=12)]
    assert labels == ["LocalSGD(every=1)", "DiLoCo(every=1)", "LocalSGD(every=50)",
                      "DiLoCo(every=50)",
                      "DiLoCo(every=50, fragments=10, overlap=True, comm_dtype='bf16')"]
    # Fragments divide H and never outnumber the blocks.
    assert candidate_modes((100,), num_layers=3)[-1].fragments == 2
    with pytest.raises(ValueError, match="need 2\\+ nodes") as err:
        row(LocalSGD(every=10), hw=replace(SLOW, num_nodes=1))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="every must be a positive integer"):
        candidate_modes((0,), num_layers=12)


def test_ethernet_1g_recommends_semi_sync_over_ddp(capsys):
    for strategies in (["ddp"], None):
        report = plan(GPT2, SLOW, batch_size_per_device=8, strategies=strategies)
        assert link_is_slow(report)
        semi = plan_semi_sync(report)
        assert semi.recommended is not None, semi.reason
        assert semi.recommended.samples_per_second >= (1 + MARGIN) * semi.baseline.samples_per_second
        assert semi.recommended.samples_per_second > 2 * report.prediction("ddp").samples_per_second
        assert semi.recommended.label.startswith("Parallel(dp_replicate=2, dp_shard=8, semi_sync=")
    assert main([*CLI_GPT2, "--inter-node", "ethernet-1g", "--strategies", "ddp",
                 "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommendation"] == "ddp"  # the synchronous table is unchanged
    semi = data["semi_sync"]
    assert semi["baseline"] == "ddp" and semi["recommendation"].startswith("Parallel(")
    assert len(semi["rows"]) == 9 and semi["why"].startswith("shown because")


def test_cli_text_names_the_semi_sync_layout_and_its_caveat(capsys):
    assert main([*CLI_GPT2, "--inter-node", "ethernet-1g", "--strategies", "ddp,hybrid"]) == 0
    out = capsys.readouterr().out
    assert "semi-sync recommendation: Parallel(dp_replicate=2, dp_shard=8, semi_sync=" in out
    assert f"caveat: {CAVEAT}" in out and "not a convergence guarantee" in out
    assert out.count("DiLoCo(every=") == 6 + 2  # 6 rows, the recommendation and its reason


@pytest.mark.parametrize("inter", ["infiniband-ndr", "infiniband-hdr"])
def test_fast_links_stay_synchronous(inter, capsys):
    report = plan(GPT2, cluster(inter), batch_size_per_device=8)
    assert not link_is_slow(report)
    semi = plan_semi_sync(report)  # forced: costed, never recommended
    assert semi.recommended is None and semi.reason.startswith("stay synchronous")
    assert main([*CLI_GPT2, "--inter-node", inter]) == 0
    assert "semi-sync" not in capsys.readouterr().out
    assert main([*CLI_GPT2, "--inter-node", inter, "--semi-sync", "50", "--json", "-"]) == 0
    data = json.loads(capsys.readouterr().out)["semi_sync"]
    assert len(data["rows"]) == 3 and data["recommendation"] == ""
    assert [r["every"] for r in data["rows"]] == [50, 50, 50]
    assert data["why"] == "--semi-sync 50"


def test_single_node_shows_no_rows(capsys):
    assert main(["--num-parameters", "124439808", "--inter-node", "ethernet-1g"]) == 0
    assert "semi-sync" not in capsys.readouterr().out
