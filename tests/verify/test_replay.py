"""``paratrain verify --replay`` passes a deterministic step and names the tensor and rank
of a digest that differs, in the replay or across replicas."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from paratrain.distributed._compat import hash_tensor
from paratrain.verify import cli as verify_module
from paratrain.verify.digests import (
    TensorDigest,
    compare_replay,
    compare_replicas,
    digest,
    tensor_digests,
)
from paratrain.verify.probe import ProbeSetup
from paratrain.verify.replay import verify_replay


# -- setups: module-level so the probe's child processes can import them -----------
def bn_model():
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Dropout(0.2),
                         nn.Linear(16, 2))


def data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 6, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long())


_calls = {"n": 0}


def flaky_step(run, model, batch):
    """A correct step, except that the 3rd micro-batch of the process (the replay's first
    with 2 steps per run) flips one bit of a gradient: a transient fault."""
    x, y = batch
    run.backward(nn.functional.cross_entropy(model(x), y))
    _calls["n"] += 1
    if _calls["n"] == 3:
        flip_bit(model[0].weight.grad, index=5, bit=3)


def flip_bit(tensor, *, index, bit):
    """Flip one bit of one float32 element, in place."""
    tensor.view(-1).view(torch.int32)[index] ^= 1 << bit


def grads_of(seed):
    g = torch.Generator().manual_seed(seed)
    return {"fc.weight": torch.randn(4, 3, generator=g), "fc.bias": torch.randn(4, generator=g)}


def rank_digests(grads, *, step=1):
    return {step: tensor_digests("gradient", grads.items(), plain_replicated=True)}


# -- pure logic ------------------------------------------------------------------------
def test_digest_sees_every_bit_position_and_shape_and_dtype():
    t = torch.randn(5, 7, generator=torch.Generator().manual_seed(0))
    base = digest(t)
    assert digest(t.clone()) == base and base.startswith("float32[5,7]:")
    for index, bit in [(0, 0), (17, 22), (34, 31)]:
        flipped = t.clone()
        flip_bit(flipped, index=index, bit=bit)
        assert digest(flipped) != base, (index, bit)
    assert digest(t.reshape(7, 5)) != base and digest(t.double()) != digest(t)
    # A plain xor of the elements would let equal values cancel and miss a permutation.
    assert digest(torch.zeros(2)) != digest(torch.ones(2))
    assert digest(torch.tensor([1.0, 2.0])) != digest(torch.tensor([2.0, 1.0]))
    assert digest(None) == "none" and digest(torch.zeros(0)).startswith("float32[0]:")


def test_digest_falls_back_to_the_bytes_where_hash_tensor_is_missing(monkeypatch):
    t = torch.randn(8, dtype=torch.bfloat16)
    assert hash_tensor(torch.arange(3)) == (0 ^ 1 ^ 2 if hasattr(torch, "hash_tensor") else None)
    monkeypatch.delattr(torch, "hash_tensor", raising=False)
    assert hash_tensor(torch.arange(3)) is None
    fallback = digest(t)
    assert fallback.startswith("bfloat16[8]:") and fallback == digest(t.clone())
    flip_bit(t.view(-1, 2).view(torch.float32), index=1, bit=0)
    assert digest(t) != fallback
    # float8 has no hash_tensor kernel: its bytes are hashed, in any torch.
    assert digest(torch.ones(4).to(torch.float8_e4m3fn)).startswith("float8_e4m3fn[4]:")


def test_a_one_bit_flip_in_one_ranks_gradient_is_named_with_rank_and_tensor():
    """Four data-parallel replicas hold the reduced gradients; rank 2's copy has one bit
    flipped: the majority (0, 1, 3) outvotes it."""
    grads = [grads_of(0) for _ in range(4)]
    assert compare_replicas([rank_digests(g) for g in grads]).ok
    flip_bit(grads[2]["fc.bias"], index=1, bit=0)
    result = compare_replicas([rank_digests(g) for g in grads])
    assert not result.ok
    assert result.mismatch.ranks == (2,) and result.mismatch.label == "gradient 'fc.bias'"
    assert result.mismatch.format().startswith(
        "differs at step 1: gradient 'fc.bias' on rank 2 (ranks 0, 1, 3 agree on float32[4]:")


def test_two_ranks_that_disagree_are_both_named_without_a_majority():
    a, b = grads_of(0), grads_of(0)
    flip_bit(b["fc.weight"], index=0, bit=12)
    mismatch = compare_replicas([rank_digests(a), rank_digests(b)]).mismatch
    assert mismatch.ranks == (0, 1) and "no majority" in mismatch.detail
    assert mismatch.label == "gradient 'fc.weight'"


def test_only_replicated_tensors_are_compared_across_ranks():
    """Losses, unknown layouts and BatchNorm statistics belong to one rank: never compared."""
    own = [{1: [TensorDigest("loss", "micro-batch 0", f"float32[]:{r}"),
                TensorDigest("buffer", "'bn.running_mean'", f"float32[4]:{r}", None)]}
           for r in range(3)]
    assert compare_replicas(own).compared == 0
    stats = tensor_digests("buffer", [("bn.running_mean", torch.ones(2) * 7)],
                           plain_replicated=True, local_only=["bn.running_mean"])
    assert stats[0].replicas is None
    unknown = tensor_digests("parameter", [("w", torch.ones(2))], plain_replicated=False)
    assert unknown[0].replicas is None


def test_replay_names_the_first_step_then_category_then_rank_that_differs():
    steps = [rank_digests(grads_of(r))[1] for r in range(2)]
    first = [{1: steps[r], 2: steps[r]} for r in range(2)]
    assert compare_replay(first, first).ok and compare_replay(first, first).compared == 8
    changed = {**grads_of(1)}
    flip_bit(changed["fc.weight"], index=11, bit=30)
    replay = [first[0], {1: steps[1], 2: rank_digests(changed)[1]}]
    mismatch = compare_replay(first, replay).mismatch
    assert (mismatch.step, mismatch.label, mismatch.ranks) == (2, "gradient 'fc.weight'", (1,))
    assert mismatch.detail.startswith("first run float32[4,3]:")
    missing = [first[0], {1: steps[1]}]
    assert compare_replay(first, missing).mismatch.detail.endswith("replay missing")


# -- in one process ------------------------------------------------------------------------
def test_single_process_replay_is_exact_with_dropout_and_batchnorm():
    report = verify_replay(ProbeSetup(model_fn=bn_model, data_fn=data, num_steps=2),
                           factorizations=["1x4x2"])
    assert report.ok, report.format()
    lines = report.format().splitlines()
    assert lines[1].split()[:4] == ["1x4x2", "single", "replay", "ok"]
    assert lines[2].split()[2:] == ["replicas", "ok", "(no", "replicated", "tensors", "to",
                                    "compare)"]


def test_a_transient_bit_flip_in_the_replay_is_named():
    _calls["n"] = 0
    report = verify_replay(ProbeSetup(model_fn=bn_model, data_fn=data, step_fn=flaky_step,
                                      num_steps=2), factorizations=["1x8x1"])
    assert not report.ok
    assert "replay    differs at step 1: gradient '0.weight' on rank 0 (first run " in (
        report.format())


# -- with 2 gloo ranks -------------------------------------------------------------------
@pytest.mark.slow
def test_two_rank_ddp_replay_passes_and_compares_replicas(capsys):
    argv = ["--replay", "--model", "test_replay:bn_model", "--data", "test_replay:data",
            "--factorizations", "2x4x1", "--steps", "2"]
    assert verify_module.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("2x4x1     ddp       replay    ok (")
    # 2 steps x (6 gradients + 6 parameters); BatchNorm's statistics are each rank's own.
    assert lines[2] == "2x4x1     ddp       replicas  ok (24 replicated tensors)"
    assert lines[-1] == "every step replays bitwise and replicas agree"


# -- the command ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv, message", [
    (["--replay", "--tolerance", "1e-3"], "--tolerance does not apply to --replay"),
    (["--replay", "--no-dropout"], "--no-dropout does not apply to --replay"),
    (["--replay", "--resume"], "--resume and --replay are separate checks"),
    (["--replay", "--factorizations", "2x4"], "is not WORLDxMICROxACCUM"),
])
def test_cli_bad_replay_input_is_one_line_and_exit_2(argv, message, capsys):
    assert verify_module.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
