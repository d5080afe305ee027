"""benchmarks/gpu_check.py on CPU: the report, budgets and failures, no CUDA, a dry run."""

from __future__ import annotations

import importlib.util
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


def gpt_row(variant, loss=3.0, *, step_s=0.1, traced=True):
    return {"variant": variant, "compiled": variant != "eager", "traced": traced,
            "compile_s": None, "batch_size": 16, "seq_len": 1024, "steps": 20,
            "warmup_steps": 5, "warmup_s": 1.0, "step_s": step_s,
            "tokens_per_s": 16 * 1024 / step_s, "tflops_per_device": 400.0, "mfu": 0.404,
            "flops_per_sample": 1e12, "peak_mib": 20000.0, "final_loss": loss}


GPT_DATA = {"device": "NVIDIA H100 80GB HBM3", "precision": "bf16-mixed", "peak_flops": 989.5e12,
            "model": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50304}}
THREE = [gpt_row("eager"), gpt_row("compile", step_s=0.08), gpt_row("raw+compile", step_s=0.075)]


@pytest.mark.parametrize("rows, ok, note", [
    (THREE, True, "tokens/s: compile / eager = 1.25x; raw+compile / eager = 1.33x; "
                  "compile / raw+compile = 0.94x"),
    (THREE[:2], False, "missing variant(s): raw+compile"),  # ran out of time
    ([THREE[0], gpt_row("compile", float("nan")), THREE[2]], False, None),
    # The H200 session's symptom: compile=True ran, as fast as eager, nothing traced.
    ([THREE[0], gpt_row("compile", traced=False), THREE[2]], False,
     "nothing was compiled in compile: no module ran under a Dynamo trace "
     "(torch.compiler.is_compiling() never True)"),
])
def test_gpt_section_needs_three_variants_finite_and_compiled(tmp_path, rows, ok, note):
    outcome = gpu_check_sections.gpt(FakeContext(tmp_path, {"gpt.json": GPT_DATA | {"rows": rows}}))
    assert outcome.ok is ok
    assert "| eager | 16 x 1024 | 20 | 100.0 | 163,840 | 1.00x | 400.0 | 40.4% | 20,000 | 1.0 " \
           "| - |" in outcome.table
    assert "GPT 12 x 768 (12 heads, vocab 50304), bf16-mixed on NVIDIA H100 80GB HBM3; " \
           "peak 989.5 TFLOP/s" in outcome.notes[0]
    if note:
        assert note in outcome.notes


def test_an_earlier_runs_json_in_a_reused_workdir_is_not_reported(tmp_path):
    (tmp_path / "gpt.json").write_text(json.dumps(GPT_DATA | {"rows": THREE}))
    outcome = gpu_check_sections.gpt(FakeContext(tmp_path, {}))  # this run wrote nothing
    assert not outcome.ok and outcome.table == ""
    assert outcome.notes == ["missing variant(s): compile, eager, raw+compile"]


def f8_rows(bf16_step, f8_step):
    return [gpt_row("bf16-mixed+compile", step_s=bf16_step),
            gpt_row("float8+compile", step_s=f8_step)]


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("f8_step, ok_on_cuda", [(0.08, True), (0.09, False)])
def test_float8_section_applies_the_1_2x_target_on_cuda_only(tmp_path, dry_run, f8_step,
                                                             ok_on_cuda):
    data = GPT_DATA | {"rows": f8_rows(0.1, f8_step)}
    outcome = gpu_check_sections.float8(FakeContext(tmp_path, {"float8.json": data},
                                                    dry_run=dry_run))
    assert outcome.ok is (ok_on_cuda or dry_run) and outcome.skipped is None
    assert "| float8+compile | 16 x 1024 |" in outcome.table
    assert any(n.startswith(f"float8 / bf16-mixed = {0.1 / f8_step:.2f}x tokens/s (target 1.2x")
               for n in outcome.notes)


def test_float8_section_skips_in_one_line_and_a_skip_does_not_fail(tmp_path):
    data = GPT_DATA | {"skipped": "the GPU is sm_80; float8 matmuls need sm_89 or newer",
                       "rows": []}
    section = Section("float8", "float8", 30, gpu_check_sections.float8)
    ctx = FakeContext(tmp_path, {"float8.json": data})
    outcome = section.run(ctx)
    assert outcome.ok and outcome.skipped == (
        "float8 skipped: the GPU is sm_80; float8 matmuls need sm_89 or newer")
    result = SectionResult("float8", "float8", outcome.ok, 1.0, 30, "", [outcome.skipped], [],
                           outcome.skipped)
    assert result.status == "SKIP"
    text = format_report([result], {}, command="c", dry_run=False, total_s=1)
    assert "**PASS**: 1 of 1 sections passed (1 skipped)" in text and "| float8 | SKIP |" in text


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("speedup, ok_on_cuda", [(2.4, True), (1.6, False)])
def test_cuda_graphs_section_applies_the_2x_target_on_cuda_only(tmp_path, dry_run, speedup,
                                                                ok_on_cuda):
    job = "gpt" if dry_run else "convnet"
    data = {"vs_paratrain": [{"job": job, "variant": "paratrain+compile", "ratio": 9.0},
                             {"job": job, "variant": "paratrain+cudagraphs", "ratio": speedup}]}
    ctx = FakeContext(tmp_path, {"cudagraphs.json": data}, dry_run=dry_run)
    outcome = gpu_check_sections.cudagraphs(ctx)
    assert outcome.ok is (ok_on_cuda or dry_run)
    assert any(n.startswith(f"CUDA graphs / eager = {speedup:.2f}x samples/s (target 2.0x")
               for n in outcome.notes)
    argv = ctx.commands[0].argv
    assert argv[argv.index("--jobs") + 1] == job and "paratrain+cudagraphs" in argv


def test_dry_run_commands_are_tiny_on_cpu_and_cuda_ones_sized(tmp_path):
    def argv_of(section, dry_run):
        ctx = FakeContext(tmp_path, {}, dry_run=dry_run)
        section(ctx)
        return " ".join(ctx.commands[0].argv)

    for section in (gpu_check_sections.gpt, gpu_check_sections.float8,
                    gpu_check_sections.cudagraphs):
        dry = argv_of(section, True)
        assert "--accelerator cpu" in dry and "--compile-backend eager" in dry
        assert "--accelerator cpu" not in argv_of(section, False)
    assert "--layers 16 --width 2048" in argv_of(gpu_check_sections.float8, False)
    assert "--variants bf16-mixed+compile float8+compile" in argv_of(
        gpu_check_sections.float8, True)
    cuda_bench = argv_of(gpu_check_sections.bench, False)
    assert "--strategies single,ddp+bf16-mixed --world-sizes 1" in cuda_bench
    assert sum(s.budget_s for s in gpu_check_sections.SECTIONS) == gpu_check.TOTAL_BUDGET_S
    # Every section stopped at its budget, each with its kill grace, and 10 s to spare:
    # still under the 8 minutes.
    grace = len(gpu_check_sections.SECTIONS) * gpu_check.KILL_GRACE_S
    assert gpu_check.TOTAL_BUDGET_S + grace + 10 < 8 * 60


@pytest.mark.slow
def test_dry_run_runs_every_section_tiny_on_cpu(tmp_path):
    report = tmp_path / "report.md"
    rc = gpu_check.main(["--dry-run", "--report", str(report), "--workdir",
                         str(tmp_path / "work")])
    text = report.read_text()
    assert rc == 0, text
    assert "**PASS**: 6 of 6 sections passed" in text and "Dry run on CPU" in text
    float8_runs = importlib.util.find_spec("torchao") is not None
    for i, title in enumerate(s.title for s in gpu_check_sections.SECTIONS):
        status = "SKIP" if title.startswith("float8") and not float8_runs else "PASS"
        assert f"## {i + 1}. {title}: {status}" in text
    assert "| 0 | 0 | 0 |" in text  # gpu tests: none passed, failed or errored (all skipped)
    assert "| single | 1 | ok |" in text  # bench
    assert "| convnet | cpu |" in text and "| resnet18 | cpu |" in text  # plan vs bench
    for variant in ("eager", "compile", "raw+compile"):  # GPT, each compiled one traced
        assert f"| {variant} | 2 x 16 | 2 |" in text
    compiled = [line for line in text.splitlines()
                if line.startswith("| ") and line.split("|")[1].strip().endswith("+compile")
                or line.startswith("| compile |")]
    assert len(compiled) == 2 + 2 * float8_runs and all("| yes |" in r for r in compiled)
    assert "- tokens/s: compile / eager = " in text
    if float8_runs:  # emulated on the CPU
        assert "| float8+compile | 2 x 16 | 2 |" in text and "- float8 / bf16-mixed = " in text
    assert "| gpt | paratrain+cudagraphs |" in text and "- CUDA graphs / eager = " in text
    assert sorted(os.listdir(tmp_path / "work")) == [
        "bench.json", "bench.log", "cudagraphs.json", "cudagraphs.log", "float8.json",
        "float8.log", "gpt.json", "gpt.log", "gpu_tests.log", "plan-convnet.json",
        "plan-convnet.log", "plan-resnet18.json", "plan-resnet18.log"]
