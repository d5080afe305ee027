"""The planner's context-parallel (ring) and expert-parallel (all-to-all) costs and
memory per rank: pure arithmetic, checked against the formulas written out by hand."""

import pytest

from paratrain.plan import Hardware, ModelProfile
from paratrain.plan.context_experts import (
    MOE_COLD_TRANSFERS,
    TransformerShape,
    alltoall_time,
    context_memory,
    context_memory_table,
    context_step,
    expert_memory,
    expert_memory_table,
    expert_step,
    moe_alltoall_bytes,
    ring_block_bytes,
    ring_cold_transfers,
    ring_grad_transfers,
    ring_kv_transfers,
    ring_layer_bytes,
    shape_of,
)

MB = 1e6


def profile(num_parameters: int = 1_000_000) -> ModelProfile:
    return ModelProfile(num_parameters=num_parameters, activation_bytes_per_sample=40 * MB,
                        compute_time_per_sample=0.1, num_layers=4, optimizer_step_time=0.01)


def hardware(devices: int, bandwidth: float = 1e9, latency: float = 0.0) -> Hardware:
    return Hardware(num_devices_per_node=devices, intra_node_bandwidth=bandwidth,
                    intra_node_latency=latency)


DENSE = TransformerShape(sequence=2048, width=128, attention_layers=4, attention_fraction=0.5)
MOE = TransformerShape(sequence=64, width=128, attention_layers=2, moe_layers=2, experts=8,
                       top_k=2, expert_parameters=600_000)


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_ring_makes_2_cp_minus_1_kv_hops_per_layer_and_cp_gradient_hops(cp):
    assert ring_kv_transfers(cp) == 2 * (cp - 1)
    assert ring_grad_transfers(cp) == (0 if cp == 1 else cp)
    block = 1 * 2048 / cp * 2 * 128 * 4  # one rank's stacked K and V, float32
    assert ring_block_bytes(DENSE, cp, 1) == block
    assert ring_layer_bytes(DENSE, cp, 1) == (2 * (cp - 1) + (0 if cp == 1 else cp)) * block


def test_ring_time_is_every_hop_of_every_attention_layer_on_the_link():
    cp, bw = 2, 1e9
    step = context_step(profile(), hardware(cp, bw, latency=1e-4), DENSE, cp=cp, batch=1)
    hops = 4 * (2 * (cp - 1) + cp)  # 4 attention layers
    ring = hops * (1e-4 + ring_block_bytes(DENSE, cp, 1) / bw)
    assert step.comm - step.sync == pytest.approx(ring)
    deeper = context_step(profile(), hardware(cp, bw, 1e-4),
                          TransformerShape(sequence=2048, width=128, attention_layers=8), cp=cp,
                          batch=1)
    assert deeper.comm - deeper.sync == pytest.approx(2 * ring)


@pytest.mark.parametrize("cp", [2, 4])
def test_a_wake_up_is_paid_by_each_transfer_posted_after_compute(cp):
    # Ring: cp - 1 forward hops, cp - 1 K/V hops backward and the last dK/dV hop (the
    # other dK/dV hops follow their K/V hop at once); the gradient sync's first bucket.
    assert ring_cold_transfers(cp) == 2 * cp - 1 and ring_cold_transfers(1) == 0
    wake = 1e-3
    quick = context_step(profile(), hardware(cp), DENSE, cp=cp, batch=1)
    slow = context_step(profile(), hardware(cp), DENSE, cp=cp, batch=1, wake=wake)
    assert slow.comm - quick.comm == pytest.approx((4 * (2 * cp - 1) + 1) * wake)
    quick = expert_step(profile(), hardware(cp), MOE, ep=cp, batch=1)
    slow = expert_step(profile(), hardware(cp), MOE, ep=cp, batch=1, wake=wake)
    assert slow.comm - quick.comm == pytest.approx((2 * MOE_COLD_TRANSFERS + 1) * wake)


def test_ring_hides_behind_attention_only_as_far_as_overlap_says():
    pr, hw = profile(), hardware(2, bandwidth=1e12)  # a ring far cheaper than attention
    waits = context_step(pr, hw, DENSE, cp=2, batch=1, overlap=0.0)
    hides = context_step(pr, hw, DENSE, cp=2, batch=1, overlap=1.0)
    ring = waits.comm - waits.sync
    assert waits.exposed == pytest.approx(ring + waits.sync)
    # The whole ring hides behind half the compute (the sync behind backward, too).
    assert ring > 0 and hides.exposed <= waits.exposed - ring + 1e-12
    slow = context_step(pr, hardware(2, bandwidth=1e3), DENSE, cp=2, batch=1, overlap=1.0)
    window = DENSE.attention_fraction * slow.compute
    assert slow.exposed >= (slow.comm - slow.sync) - window - 1e-12


def test_context_compute_is_one_cpth_and_the_step_adds_exposed_comm_and_optimizer():
    pr = profile()
    one = context_step(pr, hardware(1), DENSE, cp=1, batch=2)
    two = context_step(pr, hardware(2), DENSE, cp=2, batch=2)
    assert one.comm == 0 and one.compute == pytest.approx(2 * pr.step_compute_time_per_sample)
    assert two.compute == pytest.approx(one.compute / 2)
    assert two.step_time == pytest.approx(two.compute + two.exposed + two.optimizer)


def test_moe_layer_sends_tokens_times_top_k_rows_four_times():
    assert moe_alltoall_bytes(512, 2, 128, 4) == 4 * 512 * 2 * 128 * 4
    assert moe_alltoall_bytes(512, 1, 128, 2) == moe_alltoall_bytes(512, 2, 128, 4) / 4


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_all_to_all_time_is_the_share_leaving_the_rank_per_moe_layer(ep):
    bw, batch = 1e9, 8
    step = expert_step(profile(), hardware(ep, bw), MOE, ep=ep, batch=batch)
    rows = moe_alltoall_bytes(batch * 64, 2, 128, 4)
    assert step.comm - step.sync == pytest.approx(2 * (ep - 1) / ep * rows / bw)
    assert alltoall_time(rows, ep, bw, 0.0) == pytest.approx((ep - 1) / ep * rows / bw)
    assert expert_step(profile(), hardware(ep, bw, 1e-3), MOE, ep=ep, batch=batch).comm > step.comm


def test_context_activations_divide_by_cp_and_grow_with_the_sequence():
    pr = profile()
    whole = context_memory(pr, DENSE, cp=1, batch=1)
    half = context_memory(pr, DENSE, cp=2, batch=1)
    assert half.activation_memory == pytest.approx(whole.activation_memory / 2)
    assert half.param_memory == whole.param_memory == pr.param_size  # replicated
    longer = context_memory(pr, DENSE, cp=2, batch=1, sequence=4096)
    assert longer.activation_memory == pytest.approx(2 * half.activation_memory)


@pytest.mark.parametrize("ep", [1, 2, 4])
def test_expert_state_divides_by_ep_and_dense_state_does_not(ep):
    pr = profile()
    held = expert_memory(pr, MOE, ep=ep, batch=1)
    state = held.param_memory + held.grad_memory + held.optimizer_memory
    per_param = pr.param_bytes + pr.grad_bytes + pr.optimizer_bytes_per_param
    dense = (pr.num_parameters - MOE.expert_parameters) * per_param
    assert state == pytest.approx(dense + MOE.expert_parameters * per_param / ep)
    doubled = expert_memory(pr, MOE, ep=ep, batch=1, experts=16)
    assert doubled.param_memory - held.param_memory == pytest.approx(
        MOE.expert_parameters * pr.param_bytes / ep)


def test_memory_tables_have_a_row_per_length_or_expert_count_and_a_column_per_degree():
    table = context_memory_table(profile(), DENSE, sequences=[1024, 2048, 4096], cps=[1, 2, 4])
    lines = table.splitlines()
    assert lines[0].split() == ["sequence", "cp=1", "cp=2", "cp=4"] and len(lines) == 4
    row = [float(x) for x in lines[2].split()[1::2]]  # 2048 tokens: 40 MB / 1, 2, 4
    assert row == pytest.approx([40 * MB / 2**20 / c for c in (1, 2, 4)], abs=0.01)
    lines = expert_memory_table(profile(), MOE, experts=[4, 8, 16], eps=[1, 2, 4]).splitlines()
    assert lines[0].split() == ["experts", "ep=1", "ep=2", "ep=4"]
    assert [line.split()[0] for line in lines[1:]] == ["4", "8", "16"]


def test_expert_optimizer_step_is_the_share_of_parameters_held():
    pr = profile()
    step = expert_step(pr, hardware(2), MOE, ep=2, batch=1)
    held = pr.num_parameters - MOE.expert_parameters / 2
    assert step.optimizer == pytest.approx(pr.optimizer_step_time * held / pr.num_parameters)


def test_shape_of_a_moe_gpt():
    from paratrain.models import GPT

    model = GPT(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=8, experts=4, top_k=2)
    shape = shape_of(model, 16)
    assert (shape.width, shape.attention_layers, shape.moe_layers) == (8, 2, 2)
    assert (shape.experts, shape.top_k) == (4, 2)
    assert shape.expert_parameters == 2 * 2 * 4 * 8 * 32  # layers x (w_in, w_out) x E x d x 4d
    assert 0 < shape.attention_fraction < 1


@pytest.mark.parametrize("call,field", [
    (lambda: context_step(profile(), hardware(4), DENSE, cp=3, batch=1), "cp"),
    (lambda: expert_step(profile(), hardware(4), MOE, ep=3, batch=1), "ep"),
    (lambda: context_memory(profile(), DENSE, cp=4, batch=1, sequence=100), "sequence"),
    (lambda: expert_memory(profile(), MOE, ep=4, batch=1, experts=6), "experts"),
    (lambda: expert_step(profile(), hardware(2), DENSE, ep=2, batch=1), "shape.moe_layers"),
    (lambda: TransformerShape(sequence=0, width=8, attention_layers=1), "sequence"),
    (lambda: moe_alltoall_bytes(0, 2, 8, 4), "tokens"),
])
def test_bad_values_are_refused_in_one_line_naming_the_field(call, field):
    with pytest.raises(ValueError) as info:
        call()
    assert "\n" not in str(info.value) and str(info.value).startswith(field)
