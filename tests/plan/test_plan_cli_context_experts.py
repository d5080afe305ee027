"""``paratrain plan --sequence N --experts E --top-k K``: the cp/ep rows and memory tables
printed and written as JSON follow :mod:`paratrain.plan.context_experts`; bad values
exit 2 with one line naming the flag."""

from __future__ import annotations

import json

import pytest

from paratrain.plan.cli import main
from paratrain.plan.context_experts import (
    context_memory,
    context_step,
    expert_memory,
    expert_step,
)
from paratrain.plan.large_model_rows import cli_shape
from paratrain.plan.types import Hardware, ModelProfile

BASE = ["--num-parameters", "1000000000", "--layers", "24", "--time-per-sample", "30ms",
        "--activation-bytes", "200MB", "--batch-size", "4", "--bandwidth", "100GB",
        "--latency", "5us", "--device-memory", "80GB", "--strategies", "ddp,fsdp"]
MOE = ["--sequence", "4096", "--experts", "8", "--top-k", "2"]


def run_json(argv, capsys) -> dict:
    assert main([*argv, "--json", "-"]) == 0
    return json.loads(capsys.readouterr().out)


def rows(data: dict) -> dict[str, dict]:
    return {f"{r['parallel']}={r['degree']}": r for r in data["context_experts"]["rows"]}


def test_text_report_has_cp_and_ep_rows_and_both_tables(capsys):
    assert main([*BASE, *MOE]) == 0
    out = capsys.readouterr().out
    assert "recommendation: " in out  # the strategy table is still there
    section = out[out.index("context / expert parallel:"):]
    assert "sequence 4096 tokens" in section and "8 experts top-2" in section
    lines = section.splitlines()
    top = lines.index(next(line for line in lines if line.startswith("layout")))
    layouts = [line.split()[0] for line in lines[top + 1:top + 7]]
    assert layouts == ["cp=1", "cp=2", "cp=4", "ep=1", "ep=2", "ep=4"]
    assert "activations per rank (batch 4) vs sequence length:" in section
    seq = lines[top + 9:top + 14]
    assert seq[0].split() == ["sequence", "cp=1", "cp=2", "cp=4"]
    assert [line.split()[0] for line in seq[1:]] == ["4096", "8192", "16384", "32768"]
    assert seq[1].split()[1:] == ["800", "MB", "400", "MB", "200", "MB"]  # 4 x 200 MB / cp
    assert "state per rank vs experts:" in section
    assert section.rstrip().splitlines()[-4].split() == ["experts", "ep=1", "ep=2", "ep=4"]


def test_rows_follow_context_experts_functions(capsys):
    data = run_json([*BASE, *MOE], capsys)
    by = rows(data)
    assert list(by) == ["cp=1", "cp=2", "cp=4", "ep=1", "ep=2", "ep=4"]
    profile = ModelProfile(**data["profile"])
    hw = Hardware(**data["hardware"])
    shape = cli_shape(profile, sequence=4096, experts=8, top_k=2, layers=24)
    assert data["context_experts"]["shape"]["width"] == shape.width
    assert shape.expert_parameters < profile.num_parameters
    for cp in (1, 2, 4):
        step = context_step(profile, hw, shape, cp=cp, batch=4, overlap=0.0)
        row = by[f"cp={cp}"]
        assert row["step_time"] == pytest.approx(step.step_time)
        assert row["memory"] == pytest.approx(step.memory.total)
        assert row["bytes_sent"] == pytest.approx(step.traffic)
        assert row["samples_per_second"] == pytest.approx(4 * 4 / cp / step.step_time)
    # activations halve from cp=1 to cp=2 and again to cp=4; the state stays whole
    act = [by[f"cp={c}"]["activation_memory"] for c in (1, 2, 4)]
    assert act == pytest.approx([4 * 200e6, 2 * 200e6, 200e6])
    for ep in (1, 2, 4):
        step = expert_step(profile, hw, shape, ep=ep, batch=4, overlap=0.0)
        assert by[f"ep={ep}"]["step_time"] == pytest.approx(step.step_time)
        assert by[f"ep={ep}"]["memory"] == pytest.approx(step.memory.total)
    assert by["ep=2"]["memory"] < by["ep=1"]["memory"]
    assert by["ep=4"]["activation_memory"] == pytest.approx(by["ep=1"]["activation_memory"])


def test_tables_follow_memory_functions(capsys):
    data = run_json([*BASE, *MOE], capsys)
    cx = data["context_experts"]
    profile = ModelProfile(**data["profile"])
    shape = cli_shape(profile, sequence=4096, experts=8, top_k=2, layers=24)
    seq = cx["activations_vs_sequence"]
    assert list(seq) == ["4096", "8192", "16384", "32768"]
    for length, cells in seq.items():
        for cp in (1, 2, 4):
            expect = context_memory(profile, shape, cp=cp, batch=4, sequence=int(length))
            assert cells[f"cp={cp}"] == pytest.approx(expect.activation_memory)
    assert seq["8192"]["cp=2"] == pytest.approx(seq["4096"]["cp=1"])  # 2x tokens / 2 ranks
    state = cx["state_vs_experts"]
    assert list(state) == ["8", "16", "32"]
    for count, cells in state.items():
        for ep in (1, 2, 4):
            m = expert_memory(profile, shape, ep=ep, batch=1, experts=int(count))
            assert cells[f"ep={ep}"] == pytest.approx(m.total - m.activation_memory)
    assert state["16"]["ep=2"] == pytest.approx(state["8"]["ep=1"])


def test_dense_sequence_only_and_degrees_limited_by_devices(capsys):
    data = run_json([*BASE, "--sequence", "1024", "--devices-per-node", "2"], capsys)
    assert list(rows(data)) == ["cp=1", "cp=2"]
    assert "state_vs_experts" not in data["context_experts"]
    assert main([*BASE, "--sequence", "1024"]) == 0
    out = capsys.readouterr().out
    assert ", dense;" in out and "vs experts" not in out and "ep=2" not in out


def test_without_sequence_nothing_is_added_and_scaling_tables_carry_it(capsys):
    assert "context_experts" not in run_json(BASE, capsys)
    data = run_json([*BASE, "--nodes", "1,2", *MOE, "--width", "512"], capsys)
    assert data["context_experts"]["shape"]["width"] == 512
    assert data["context_experts"]["shape"]["expert_parameters"] == 24 * 8 * 8 * 512 * 512


@pytest.mark.parametrize(("argv", "flag"), [
    (["--sequence", "4092"], "--sequence"),  # not a multiple of 2 * cp = 8
    (["--sequence", "0"], "--sequence"),
    (["--sequence", "4096", "--experts", "6"], "--experts"),  # ep=4 does not divide 6
    (["--experts", "8"], "--experts"),  # needs --sequence
    (["--width", "64"], "--width"),
    (["--sequence", "64", "--top-k", "2"], "--top-k"),  # needs --experts
    (["--sequence", "64", "--experts", "2", "--top-k", "3"], "--top-k"),
    (["--sequence", "64", "--experts", "8", "--width", "4096"], "--experts"),  # too many params
])
def test_bad_values_exit_2_with_one_line(argv, flag, capsys):
    assert main([*BASE, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and flag in err, err
