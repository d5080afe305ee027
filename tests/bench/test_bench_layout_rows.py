"""Layout rows of ``paratrain bench``: ``cp=2``, ``ep=2``, ``dp_shard=2,cp=2`` run as
``Run(parallel=...)`` on the bench's GPT workloads; refusals in one line."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from paratrain.bench import jobs as bench_jobs
from paratrain.bench.cli import main
from paratrain.bench.layouts import (
    GPT_MOE_WORKLOAD,
    GPT_WORKLOAD,
    ModelFacts,
    gpt,
    gpt_moe,
    is_layout,
    layout_label,
    layout_refusal,
    model_facts,
    pick_model,
    split_rows,
)
from paratrain.bench.rows import resolve_rows
from paratrain.bench.runner import BenchConfig, check_model, preflight
from paratrain.bench.worker import DEMO_MODEL, JobSpec, TokenLoss, local_tokens


def test_layout_rows_are_labelled_by_their_canonical_degrees():
    assert is_layout("cp=2") and not is_layout("fsdp_tp")
    assert layout_label("cp=2,dp_shard=2") == "dp_shard=2,cp=2"
    rows = resolve_rows(["ddp", "cp=2", "ep=2+bf16-mixed", "single", "cp=2,dp_shard=2"],
                        precisions=["32"])
    assert [(r.label, r.layout) for r in rows] == [
        ("single", False), ("ddp", False), ("cp=2", True), ("ep=2+bf16-mixed", True),
        ("dp_shard=2,cp=2", True)]
    # A plain layout is measured at every requested precision, like a strategy.
    assert [r.label for r in resolve_rows(["cp=2"], precisions=["32", "bf16-mixed"])] == [
        "cp=2", "cp=2+bf16-mixed"]


@pytest.mark.parametrize(("item", "message"), [
    ("cq=2", "expected comma-separated degrees"),
    ("cp=two", "cp must be an integer"),
    ("cp=0", "Parallel.cp must be an integer >= 1"),
])
def test_bad_layouts_are_one_line_errors(item, message):
    with pytest.raises(ValueError, match=message):
        resolve_rows([item])


def test_the_command_line_joins_degrees_and_splits_rows_at_semicolons():
    assert split_rows("cp=2") == ["cp=2"]
    assert split_rows("dp_shard=2,cp=2") == ["dp_shard=2,cp=2"]
    assert split_rows("single,ddp,cp=2;ep=2") == ["single", "ddp", "cp=2", "ep=2"]
    assert split_rows("cp=2,ddp,ep=2") == ["cp=2", "ddp", "ep=2"]
    assert split_rows("cp=2+bf16-mixed,ep=2; ddp") == ["cp=2+bf16-mixed", "ep=2", "ddp"]


def test_the_model_follows_the_layout_rows_unless_named():
    assert pick_model(None) == pick_model(["ddp"]) == DEMO_MODEL
    assert pick_model(["ddp", "cp=2"]) == GPT_WORKLOAD
    assert pick_model(["cp=2", "dp_shard=2,ep=2+bf16-mixed"]) == GPT_MOE_WORKLOAD
    config = BenchConfig(strategies=("cp=2", "ep=2"), accelerator="cpu")
    assert (config.model, config.input_shape, config.vocab_size) == (GPT_MOE_WORKLOAD, (64,), 256)
    assert BenchConfig(accelerator="cpu").input_shape == (1, 28, 28)
    named = BenchConfig(model="paratrain.models:gpt_bench", accelerator="cpu")
    assert (named.input_shape, named.vocab_size) == ((64,), 512)
    spec = config.job_spec("cp=2", accelerator="cpu")
    assert (spec.strategy, spec.vocab_size) == ("cp=2", 256)
    assert bench_jobs.server_args("cp=2") == (0, [])


def test_model_facts_see_attention_and_experts():
    sample = torch.randint(256, (2, 64))
    dense, moe = (model_facts(m(), sample, "m", vocab_size=256) for m in (gpt, gpt_moe))
    assert (dense.tokens, dense.sequence, dense.sdpa, dense.experts) == (True, 64, True, ())
    assert moe.experts == (4, 4)
    conv = check_model(BenchConfig(accelerator="cpu"))
    assert not conv.tokens and not conv.sdpa


GPT_FACTS = ModelFacts(name="m:gpt", tokens=True, sequence=64, sdpa=True)
MOE_FACTS = ModelFacts(name="m:moe", tokens=True, sequence=64, sdpa=True, experts=(4, 4))


@pytest.mark.parametrize(("label", "world_size", "facts", "message"), [
    ("cp=2", 1, GPT_FACTS, "Parallel.cp=2 does not divide the world size 1"),
    ("dp_shard=2,cp=2", 2, GPT_FACTS, "= 4 but the world size is 2"),
    ("ep=2", 1, MOE_FACTS, "Parallel.ep=2 must divide dp_shard x cp = 1"),
    ("cp=2", 2, ModelFacts(name="m:conv"), "cp=2 needs a token model"),
    ("cp=2", 2, ModelFacts(name="m:lstm", tokens=True, sequence=64),
     "cp=2 needs a model calling F.scaled_dot_product_attention"),
    ("cp=2", 2, ModelFacts(name="m:gpt", tokens=True, sequence=6, sdpa=True),
     "divisible by 2 x cp = 4; the input has 6 tokens"),
    ("ep=2", 2, GPT_FACTS, "ep=2 needs a model with mixture-of-experts layers; m:gpt has none"),
    ("ep=4", 4, ModelFacts(name="m:moe", tokens=True, sequence=64, experts=(6,)),
     "ep=4 must divide the expert count; m:moe has 6 experts"),
])
def test_what_a_layout_row_cannot_run_is_refused_in_one_line(label, world_size, facts, message):
    reason = layout_refusal(label, world_size, facts)
    assert message in reason and "\n" not in reason
    assert preflight(label, world_size, "cpu", facts) == reason


def test_layouts_that_fit_are_not_refused():
    assert layout_refusal("cp=2", 2, GPT_FACTS) == ""
    assert layout_refusal("ep=2", 2, MOE_FACTS) == ""
    assert layout_refusal("dp_shard=2,cp=2,ep=4", 4, MOE_FACTS) == ""
    assert preflight("ep=2", 4, "cpu", MOE_FACTS) == ""


def test_without_context_parallel_token_batches_pass_unchanged():
    class Plain:
        class strategy:  # noqa: N801 - stands in for run.strategy
            local_batch = staticmethod(lambda batch: batch)

    x, targets = torch.randint(8, (2, 4)), torch.randint(8, (2, 4))
    batches, loss = local_tokens(Plain, [x], TokenLoss(targets, 8))
    assert batches[0] is x and loss.targets is targets
    float_loss = lambda out: out.sum()  # noqa: E731
    assert local_tokens(Plain, [x], float_loss) == ([x], float_loss)
    assert JobSpec(strategy="dp_shard=2,cp=2", input_shape=(8,), vocab_size=8).strategy


def test_a_convnet_bench_refuses_cp_rows_in_one_line(capsys, tmp_path):
    # The model is named, so the layout row cannot swap it for a GPT: skipped, with the reason.
    json_path = tmp_path / "out.json"
    assert main([DEMO_MODEL, "--strategies", "cp=2", "--world-sizes", "2", "--accelerator",
                 "cpu", "--json", str(json_path)]) == 0
    row, = json.loads(json_path.read_text())["rows"]
    assert row["status"] == "skipped" and row["reason"].startswith("cp=2 needs a token model")


@pytest.mark.slow
def test_bench_measures_cp_and_ep_rows_on_two_processes(tmp_path):
    json_path = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "paratrain.cli", "bench", "--strategies", "cp=2;ep=2",
           "--world-sizes", "2", "--accelerator", "cpu", "--batch-size", "4", "--warmup", "1",
           "--steps", "2", "--repeats", "1", "--threads", "1", "--timeout", "120",
           "--json", str(json_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    table = result.stdout.splitlines()
    assert table[0].startswith("strategy")
    rows = {line.split()[0]: line for line in table[2:]}
    assert set(rows) == {"cp=2", "ep=2"}, result.stdout
    data = {r["strategy"]: r for r in json.loads(json_path.read_text())["rows"]}
    for label in ("cp=2", "ep=2"):
        assert data[label]["status"] == "ok", data[label]["reason"]
        assert data[label]["samples_per_s"] > 0
        assert f"{data[label]['samples_per_s']:,.1f}" in rows[label]
    # cp: both ranks read one sequence (data parallel 1); ep: two data ranks.
    assert data["cp=2"]["samples_per_step"] == 4 and data["ep=2"]["samples_per_step"] == 8
    assert "cp=2" in data["cp=2"]["note"] and "dp_shard=2,ep=2" in data["ep=2"]["note"]
