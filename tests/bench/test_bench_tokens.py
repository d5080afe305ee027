"""Bench jobs with token inputs (``JobSpec.vocab_size``): a GPT under ``tp``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from paratrain.bench import jobs as bench_jobs
from paratrain.bench.worker import JobSpec, make_batch, make_loss
from paratrain.models import GPT, gpt_bench


@pytest.mark.parametrize("value", [1, 0, True, 8.0, "512"])
def test_vocab_size_must_be_an_integer_of_at_least_two(value):
    with pytest.raises(ValueError, match="vocab_size"):
        JobSpec(strategy="tp", input_shape=(8,), vocab_size=value)


def test_spec_round_trips_its_vocab_size(tmp_path):
    spec = JobSpec(strategy="tp", model="paratrain.models:gpt_bench", input_shape=(64,),
                   vocab_size=512)
    spec.write(tmp_path / "spec.json")
    assert JobSpec.read(tmp_path / "spec.json") == spec


def test_batches_are_tokens_when_a_vocabulary_is_set_and_follow_the_seed():
    spec = JobSpec(strategy="tp", input_shape=(8,), batch_size=3, vocab_size=5)
    tokens = make_batch(spec, torch.Generator().manual_seed(1))
    assert tokens.dtype == torch.int64 and tokens.shape == (3, 8)
    assert 0 <= tokens.min() and tokens.max() < 5
    assert torch.equal(tokens, make_batch(spec, torch.Generator().manual_seed(1)))
    floats = make_batch(JobSpec(strategy="ddp", input_shape=(2, 2), batch_size=3),
                        torch.Generator())
    assert floats.dtype == torch.float32 and floats.shape == (3, 2, 2)


def test_token_loss_is_cross_entropy_against_random_tokens():
    logits = torch.randn(2, 4, 7)
    loss_fn = make_loss(logits, 2, torch.Generator().manual_seed(3), vocab_size=7)
    targets = torch.randint(0, 7, (2, 4), generator=torch.Generator().manual_seed(3))
    assert loss_fn(logits).item() == pytest.approx(
        F.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1)).item())
    with pytest.raises(ValueError, match="vocab_size=9"):
        make_loss(logits, 2, torch.Generator(), vocab_size=9)


def test_gpt_bench_takes_64_tokens_of_a_512_vocabulary():
    model = gpt_bench()
    assert model(torch.randint(512, (1, 64))).shape == (1, 64, 512)


TINY = ("from paratrain.models import GPT\n\n"
        "def tiny():\n"
        "    return GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)\n")


@pytest.mark.slow
def test_a_tensor_parallel_job_trains_on_tokens(tmp_path, monkeypatch):
    (tmp_path / "tinygpt.py").write_text(TINY)
    monkeypatch.chdir(tmp_path)  # job_env puts the working directory on the workers' path
    spec = JobSpec(strategy="tp", model="tinygpt:tiny", input_shape=(8,), vocab_size=16,
                   batch_size=2, warmup_steps=1, steps=1, repeats=1, accelerator="cpu")
    spec.write(tmp_path / "spec.json")
    argv = bench_jobs.local_launch_argv(tmp_path / "spec.json", tmp_path / "out", strategy="tp",
                                        world_size=2)
    outcome = bench_jobs.run_local(argv, tmp_path / "out", env=bench_jobs.job_env(threads=1),
                                   timeout=180)
    assert outcome.ok, outcome.reason
    assert [(r["rank"], r["strategy"], r["data_parallel_size"]) for r in outcome.results] == [
        (0, "tp", 1), (1, "tp", 1)]
    # Split layers: each rank holds less than the whole model's parameters.
    tiny = GPT(vocab_size=16, block_size=8, n_layer=1, n_head=2, n_embd=8)
    whole = sum(p.numel() * 4 for p in tiny.parameters())
    assert all(r["param_bytes"] < whole for r in outcome.results)
