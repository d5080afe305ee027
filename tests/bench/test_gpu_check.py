"""benchmarks/gpu_check.py on CPU: the report, budgets and failures, no CUDA, a dry run."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time

import pytest
import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))

import gpu_check  # noqa: E402
import gpu_check_sections  # noqa: E402
from gpu_check import (  # noqa: E402
    NO_CUDA,
    CommandResult,
    Context,
    Outcome,
    Section,
    SectionResult,
    format_report,
    run_sections,
)

PY = sys.executable


def command(code: str) -> list[str]:
    return [PY, "-c", code]


def test_report_holds_device_commands_tables_times_and_verdicts():
    ok = SectionResult("bench", "paratrain bench", True, 12.34, 80, "| a |\n|---|\n| 1 |", [],
                       [CommandResult([PY, "-m", "paratrain.cli", "bench"], 0, 12.0, "fine")])
    bad = SectionResult("gpt", "GPT-2 small", False, 3.0, 110, "", ["missing variant(s): compile"],
                        [CommandResult([PY, "x.py", "--json", "a b"], 1, 2.5,
                                       "line\n" * 40 + "Traceback: boom\n")])
    info = {"device": "NVIDIA H100 80GB HBM3 (1 visible)", "torch": "2.14.1", "CUDA": "13.0"}
    text = format_report([ok, bad], info, command="python3 benchmarks/gpu_check.py",
                         dry_run=False, total_s=15.3)
    assert "**FAIL**: 1 of 2 sections passed, 15 s in all" in text
    assert "| device | NVIDIA H100 80GB HBM3 (1 visible) |" in text
    assert "| CUDA | 13.0 |" in text and "| command | `python3 benchmarks/gpu_check.py` |" in text
    assert "| paratrain bench | PASS | 12.3 | 80 |" in text
    assert "| GPT-2 small | FAIL | 3.0 | 110 |" in text
    assert "## 1. paratrain bench: PASS" in text and "## 2. GPT-2 small: FAIL" in text
    name = pathlib.Path(PY).name
    assert f"$ {name} -m paratrain.cli bench   # exit 0, 12.0 s" in text
    assert f"$ {name} x.py --json 'a b'   # exit 1, 2.5 s" in text  # quoted as a shell line
    assert "| a |\n|---|\n| 1 |" in text and "- missing variant(s): compile" in text
    # A failed command's last lines are in the report, a passed one's are not.
    assert "Traceback: boom" in text and "fine" not in text
    assert text.count("\nline") == gpu_check.TAIL_LINES - 1
    assert "Dry run" not in text


def test_a_failing_section_is_fail_and_later_sections_still_run(tmp_path, capsys):
    ran = []

    def raises(ctx):
        ran.append("raises")
        raise RuntimeError("section bug")

    def exits_3(ctx):
        ran.append("exits_3")
        result = ctx.run(command("print('partial table'); raise SystemExit(3)"), "three")
        return Outcome(result.ok, "| partial |", [])

    def passes(ctx):
        ran.append("passes")
        result = ctx.run(command("print('hello')"), "hello")
        return Outcome(result.ok and "hello" in result.output, "| t |")

    sections = [Section("a", "raises", 30, raises), Section("b", "exits 3", 30, exits_3),
                Section("c", "passes", 30, passes)]
    results = run_sections(sections, dry_run=True, workdir=tmp_path)
    assert ran == ["raises", "exits_3", "passes"]
    assert [r.status for r in results] == ["FAIL", "FAIL", "PASS"]
    assert results[0].notes == ["section raised RuntimeError: section bug"]
    assert results[1].commands[0].returncode == 3 and results[1].table == "| partial |"
    assert (tmp_path / "hello.log").read_text() == "hello\n"
    out = capsys.readouterr().out
    assert "[1/3] a: FAIL" in out and "[3/3] c: PASS" in out


def _state(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="needs /proc")
def test_a_section_over_its_budget_is_killed_with_its_children(tmp_path):
    # A launcher-like tree: the child starts a grandchild in a session of its own (as
    # torchrun starts its workers) and both would sleep a minute.
    code = ("import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(60)'], start_new_session=True); print(p.pid, flush=True); "
            "time.sleep(60)")

    def hangs(ctx):
        return Outcome(ctx.run(command(code), "hang").ok)

    def after(ctx):
        return Outcome(True, "| after |")

    started = time.monotonic()
    hung, later = run_sections([Section("hang", "hangs", 2, hangs),
                                Section("after", "after", 30, after)],
                               dry_run=True, workdir=tmp_path)
    assert time.monotonic() - started < 2 + gpu_check.KILL_GRACE_S + 10
    assert hung.status == "FAIL" and hung.commands[0].timed_out
    assert any("budget ran out" in n for n in hung.notes)
    assert later.status == "PASS"
    grandchild = int(hung.commands[0].output.split()[0])
    deadline = time.monotonic() + 10
    while _state(grandchild) not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(grandchild) in ("gone", "Z")


def test_sections_after_the_total_budget_are_fail_without_running(tmp_path):
    ran = []

    def slow(ctx):
        ran.append("slow")
        time.sleep(0.6)
        return Outcome(True)

    def never(ctx):
        ran.append("never")
        return Outcome(True)

    first, second = run_sections([Section("s", "slow", 30, slow), Section("n", "never", 30, never)],
                                 dry_run=True, workdir=tmp_path, total_budget_s=0.5)
    assert ran == ["slow"]
    assert first.budget_s == pytest.approx(0.5, abs=0.05)
    assert second.status == "FAIL" and second.budget_s == 0
    assert second.notes == ["not run: the total budget was spent by earlier sections"]


def test_without_cuda_one_line_exit_2_and_no_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = tmp_path / "r.md"
    assert gpu_check.main(["--report", str(report)]) == 2
    captured = capsys.readouterr()
    assert captured.err == NO_CUDA + "\n" and captured.out == ""
    assert NO_CUDA.startswith("gpu-check: no CUDA device visible "
                              "(torch.cuda.is_available() is False)")
    assert not report.exists()


@pytest.mark.parametrize("flag", ["nope=3", "gpt=-1", "gpt"])
def test_a_bad_budget_is_one_line(flag, capsys):
    assert gpu_check.main(["--dry-run", "--budget", flag]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gpu-check: --budget {flag!r}: expected NAME=SECONDS")
    assert err.count("\n") == 1


def test_pytest_counts_read_the_summary_line():
    out = "x\nFAILED tests/gpu/a.py::t\n=== 1 failed, 2 passed, 3 skipped, 1 error in 4.5s ==="
    assert gpu_check_sections.pytest_counts(out) == {
        "failed": 1, "passed": 2, "skipped": 3, "error": 1}
    assert gpu_check_sections.pytest_counts("ImportError: no pytest") == {}


class FakeContext(Context):
    """Runs nothing: writes the JSON a command would have written."""

    def __init__(self, tmp_path, files, *, dry_run=False):
        super().__init__(dry_run=dry_run, workdir=tmp_path, deadline=time.monotonic() + 60)
        self.files = files

    def run(self, argv, log_name):
        name = f"{log_name}.json"
        if name in self.files:
            (self.workdir / name).write_text(json.dumps(self.files[name]))
        result = CommandResult(argv, 0, 0.1, "")
        self.commands.append(result)
        return result


def plan_row(error):
    return {"device": "cuda:0", "measured_s": 0.01, "predicted_s": 0.01 * (1 + error),
            "error": error}


@pytest.mark.parametrize("dry_run", [False, True])
def test_plan_section_applies_the_20_percent_bar_on_cuda_only(tmp_path, dry_run):
    ctx = FakeContext(tmp_path, {"plan-convnet.json": plan_row(0.19),
                                 "plan-resnet18.json": plan_row(-0.25)}, dry_run=dry_run)
    outcome = gpu_check_sections.plan_vs_bench(ctx)
    assert "| convnet | cuda:0 | 10.000 | 11.900 | +19.0% | yes |" in outcome.table
    assert "| resnet18 | cuda:0 | 10.000 | 7.500 | -25.0% | NO |" in outcome.table
    assert outcome.ok is dry_run


def gpt_row(variant, loss=3.0):
    return {"variant": variant, "batch_size": 16, "seq_len": 1024, "steps": 20,
            "warmup_steps": 5, "warmup_s": 1.0, "step_s": 0.1, "tokens_per_s": 163840.0,
            "tflops_per_device": 400.0, "mfu": 0.404, "flops_per_sample": 1e12,
            "peak_mib": 20000.0, "final_loss": loss}


@pytest.mark.parametrize("rows, ok", [
    ([gpt_row("eager"), gpt_row("compile")], True),
    ([gpt_row("eager")], False),  # the compiled variant ran out of time
    ([gpt_row("eager"), gpt_row("compile", float("nan"))], False),
])
def test_gpt_section_needs_both_variants_with_finite_losses(tmp_path, rows, ok):
    data = {"device": "NVIDIA H100 80GB HBM3", "precision": "bf16-mixed", "peak_flops": 989.5e12,
            "model": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50304},
            "rows": rows}
    outcome = gpu_check_sections.gpt(FakeContext(tmp_path, {"gpt.json": data}))
    assert outcome.ok is ok
    assert "| eager | 16 x 1024 | 20 | 100.0 | 163,840 | 400.0 | 40.4% | 20,000 |" in outcome.table
    assert "GPT 12 x 768 (12 heads, vocab 50304), bf16-mixed on NVIDIA H100 80GB HBM3; " \
           "peak 989.5 TFLOP/s" in outcome.notes[0]


def test_an_earlier_runs_json_in_a_reused_workdir_is_not_reported(tmp_path):
    (tmp_path / "gpt.json").write_text(json.dumps({"rows": [gpt_row("eager"),
                                                            gpt_row("compile")]}))
    outcome = gpu_check_sections.gpt(FakeContext(tmp_path, {}))  # this run wrote nothing
    assert not outcome.ok and outcome.table == ""
    assert outcome.notes == ["missing variant(s): compile, eager"]


@pytest.mark.slow
def test_dry_run_runs_every_section_tiny_on_cpu(tmp_path):
    report = tmp_path / "report.md"
    rc = gpu_check.main(["--dry-run", "--report", str(report), "--workdir",
                         str(tmp_path / "work")])
    text = report.read_text()
    assert rc == 0, text
    assert "**PASS**: 5 of 5 sections passed" in text and "Dry run on CPU" in text
    for i, title in enumerate(s.title for s in gpu_check_sections.SECTIONS):
        assert f"## {i + 1}. {title}: PASS" in text
    assert "| 0 | 0 | 0 |" in text  # gpu tests: none passed, failed or errored (all skipped)
    assert "| single | 1 | ok |" in text  # bench
    assert "| convnet | cpu |" in text and "| resnet18 | cpu |" in text  # plan vs bench
    assert "| gpt | raw |" in text and "| gpt | paratrain |" in text  # peers
    assert "| eager | 2 x 16 | 2 |" in text and "| compile | 2 x 16 | 2 |" in text  # GPT
    assert sorted(os.listdir(tmp_path / "work")) == [
        "bench.json", "bench.log", "gpt.json", "gpt.log", "gpu_tests.log", "peers-gpt.log",
        "plan-convnet.json", "plan-convnet.log", "plan-resnet18.json", "plan-resnet18.log"]
