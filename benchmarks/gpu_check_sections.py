"""The sections of ``gpu_check.py``: the commands each runs (CUDA or tiny dry run) and its table.

Each function takes the check's :class:`gpu_check.Context`, runs existing tools through
``ctx.run`` (pytest, ``paratrain bench``, ``plan_validation.py --single-device``,
``gpu_peers.py``, ``gpu_check_gpt.py``) and turns their JSON or output into a markdown
table and a PASS/FAIL :class:`gpu_check.Outcome`.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from gpu_check import Context, Outcome, Section
from gpu_check_gpt import markdown_table as gpt_table
from gpu_check_gpt import row_ok

PY = sys.executable
PLAN_TOLERANCE = 0.20  # the plan's bar: predicted step time within 20% of the measured one
PEER_JOBS = ("convnet", "resnet18")  # the GPT has its own section (eager and compiled)
_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def _fresh(path: Path) -> Path:
    """``path`` with any earlier run's file removed: a reused --workdir must not show old rows."""
    path.unlink(missing_ok=True)
    return path


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _num(row: dict[str, Any], key: str, scale: float, fmt: str) -> str:
    return "-" if row.get(key) is None else format(row[key] * scale, fmt)


def pytest_counts(output: str) -> dict[str, int]:
    """Outcome counts from pytest's last summary line (``3 passed, 2 skipped in 4.1s``)."""
    for line in reversed(output.splitlines()):
        found = _PYTEST_COUNT.findall(line)
        if found and " in " in line:
            counts = {word.rstrip("s") if word.startswith("error") else word: int(n)
                      for n, word in found}
            return counts
    return {}


def gpu_tests(ctx: Context) -> Outcome:
    """The ``gpu`` test tier: pytest on tests/gpu (all skipped where CUDA is hidden)."""
    result = ctx.run([PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/gpu"],
                     "gpu_tests")
    counts = pytest_counts(result.output)
    table = "\n".join(["| passed | failed | errors | skipped |", "|---:|---:|---:|---:|",
                       "| " + " | ".join(str(counts.get(k, 0)) for k in
                                         ("passed", "failed", "error", "skipped")) + " |"])
    notes = [line.strip() for line in result.output.splitlines()
             if line.startswith(("FAILED", "ERROR"))][:20]
    ok = result.ok and bool(counts)
    if ctx.dry_run:
        notes.append("dry run: CUDA is hidden, so every gpu test is collected and skipped")
    elif ok and not counts.get("passed"):
        ok = False
        notes.append("no gpu test ran on a CUDA machine (all skipped)")
    return Outcome(ok, table, notes)


def bench(ctx: Context) -> Outcome:
    """``paratrain bench`` with its default rows (on CUDA: the seeds' table)."""
    path = _fresh(ctx.workdir / "bench.json")
    argv = [PY, "-m", "paratrain.cli", "bench", "--json", str(path)]
    if ctx.dry_run:
        argv += ["--accelerator", "cpu", "--strategies", "single", "--world-sizes", "1",
                 "--batch-size", "8", "--warmup", "1", "--steps", "2", "--repeats", "1",
                 "--threads", "1"]
    result = ctx.run(argv, "bench")
    rows = (_json(path) or {}).get("rows", [])
    lines = ["| row | N | status | samples/s | step (ms) | peak mem/rank (MiB) | GPU % | note |",
             "|---|---:|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['world_size']} | {r['status']} | "
                     f"{_num(r, 'samples_per_s', 1, ',.1f')} | "
                     f"{_num(r, 'step_time_s', 1e3, '.2f')} | "
                     f"{_num(r, 'peak_memory_bytes', 2**-20, ',.0f')} | "
                     f"{_num(r, 'gpu_percent', 1, '.0f')} | {r.get('reason') or r.get('note') or ''} |")
    failed = [r["label"] for r in rows if r["status"] == "failed"]
    notes = [f"failed rows: {', '.join(failed)}"] if failed else []
    ok = result.ok and any(r["status"] == "ok" for r in rows) and not failed
    return Outcome(ok, "\n".join(lines) if rows else "", notes)


PLAN_MODELS = {  # name: (model, input shape on CUDA, input shape in a dry run)
    "convnet": ("paratrain.models:convnet", "1,28,28", "1,28,28"),
    "resnet18": ("torchvision.models:resnet18", "3,224,224", "3,32,32"),
}


def plan_vs_bench(ctx: Context) -> Outcome:
    """``plan``'s calibrated single-device step against a real ``single`` bench job."""
    lines = ["| model | device | measured step (ms) | predicted step (ms) | error | "
             f"within {PLAN_TOLERANCE:.0%} |", "|---|---|---:|---:|---:|---|"]
    ok, notes = True, []
    for name, (model, shape, dry_shape) in PLAN_MODELS.items():
        path = _fresh(ctx.workdir / f"plan-{name}.json")
        argv = [PY, "benchmarks/plan_validation.py", "--single-device", "--model", model,
                "--input-shape", dry_shape if ctx.dry_run else shape, "--json", str(path)]
        if ctx.dry_run:  # the bar is about GPU numbers; a dry run proves the plumbing
            argv += ["--batch-size", "4", "--warmup", "1", "--steps", "2", "--repeats", "1",
                     "--tolerance", "1e9"]
        result = ctx.run(argv, f"plan-{name}")
        row = _json(path)
        if row is None:
            ok = False
            notes.append(f"{name}: no result (exit {result.returncode})")
            continue
        within = abs(row["error"]) <= PLAN_TOLERANCE
        ok = ok and result.ok and (within or ctx.dry_run)
        lines.append(f"| {name} | {row['device']} | {row['measured_s'] * 1e3:.3f} | "
                     f"{row['predicted_s'] * 1e3:.3f} | {row['error']:+.1%} | "
                     f"{'yes' if within else 'NO'} |")
    if ctx.dry_run:
        notes.append(f"dry run: the {PLAN_TOLERANCE:.0%} bar is shown, not applied")
    return Outcome(ok, "\n".join(lines) if len(lines) > 2 else "", notes)


def peers(ctx: Context) -> Outcome:
    """``gpu_peers.py``: raw / Accelerate / Fabric / paratrain (+compile, +CUDA graphs)."""
    if ctx.dry_run:
        jobs = {"gpt": ["--accelerator", "cpu", "--variants", "raw", "paratrain",
                        "--repeats", "1", "--warmup", "1", "--steps", "1", "--samples", "16",
                        "--batch-size", "4", "--seq-len", "16", "--gpt-layers", "1",
                        "--gpt-width", "32"]}
    else:
        jobs = {job: ["--accelerator", "cuda", "--repeats", "1", "--warmup", "3",
                      "--steps", "15"] for job in PEER_JOBS}
    head: list[str] = []
    rows: list[str] = []
    ok, notes = True, []
    for job, flags in jobs.items():
        result = ctx.run([PY, "benchmarks/gpu_peers.py", "--jobs", job, *flags], f"peers-{job}")
        table = [line for line in result.output.splitlines() if line.startswith("|")]
        head = head or table[:2]
        rows += table[2:]
        notes += [line for line in result.output.splitlines() if line.startswith("skipping")]
        if not (result.ok and table[2:]):
            ok = False
            notes.append(f"{job}: no table (exit {result.returncode})")
    if not ctx.dry_run:
        notes.append("1 repeat of 15 steps after 3 warm-up steps per variant (budget); "
                     "the full comparison is `python benchmarks/gpu_peers.py`")
    return Outcome(ok, "\n".join(head + rows) if rows else "", notes)


def gpt(ctx: Context) -> Outcome:
    """GPT-2 small (124M) under ``Run``: tokens/s and MFU, eager and compiled."""
    path = _fresh(ctx.workdir / "gpt.json")
    argv = [PY, "benchmarks/gpu_check_gpt.py", "--json", str(path)]
    if ctx.dry_run:
        # The eager backend walks the compile path without minutes of CPU code generation;
        # a nominal 1 TFLOP/s peak makes the MFU column computed.
        argv += ["--accelerator", "cpu", "--layers", "1", "--width", "32", "--seq-len", "16",
                 "--batch-size", "2", "--warmup", "1", "--steps", "2",
                 "--compile-backend", "eager", "--peak-flops", "1e12"]
    result = ctx.run(argv, "gpt")
    data = _json(path) or {}
    rows = data.get("rows", [])
    notes = []
    if data:
        model = data["model"]
        peak = data["peak_flops"]
        notes.append(f"GPT {model['n_layer']} x {model['n_embd']} ({model['n_head']} heads, "
                     f"vocab {model['vocab_size']}), {data['precision']} on {data['device']}; "
                     f"peak {'n/a' if peak is None else f'{peak / 1e12:.1f} TFLOP/s'}"
                     + (" (nominal, dry run)" if ctx.dry_run else ""))
    missing = {"eager", "compile"} - {r["variant"] for r in rows}
    if missing:
        notes.append(f"missing variant(s): {', '.join(sorted(missing))}")
    ok = result.ok and not missing and all(row_ok(r) for r in rows)
    return Outcome(ok, gpt_table(rows) if rows else "", notes)


SECTIONS = (
    Section("gpu_tests", "gpu test tier (tests/gpu)", 120, gpu_tests),
    Section("bench", "paratrain bench, default rows", 80, bench),
    Section("plan", "plan vs bench, ConvNet and ResNet-18", 60, plan_vs_bench),
    Section("peers", "peers: raw, Accelerate, Fabric, paratrain", 120, peers),
    Section("gpt", "GPT-2 small (124M): tokens/s and MFU", 110, gpt),
)
