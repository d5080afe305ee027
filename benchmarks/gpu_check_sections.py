"""The sections of ``gpu_check.py``: the commands each runs (CUDA or tiny dry run) and its table.

Each function takes the check's :class:`gpu_check.Context`, runs existing tools through
``ctx.run`` (pytest, ``paratrain bench``, ``plan_validation.py --single-device``,
``gpu_check_gpt.py``, ``gpu_peers.py``) and turns their JSON or output into a markdown
table and a PASS/FAIL/SKIP :class:`gpu_check.Outcome`. Every claim is a ratio of two
runs in one process on one device: compile vs eager vs raw ``torch.compile`` (``gpt``),
float8 vs bf16 (``float8``, target 1.2x), CUDA graphs vs eager (``cudagraphs``, 2x).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from gpu_check import Context, Outcome, Section
from gpu_check_gpt import markdown_table as gpt_table
from gpu_check_gpt import ratio, row_ok

PY = sys.executable
PLAN_TOLERANCE = 0.20  # the plan's bar: predicted step time within 20% of the measured one
FLOAT8_TARGET = 1.2  # float8+compile tokens/s over bf16-mixed+compile's
CUDA_GRAPHS_TARGET = 2.0  # ConvNet batch 64: reduce-overhead samples/s over eager's
# On CUDA, two rows of the bench's five (single float32, ddp in bf16-mixed: a wrapper
# and mixed precision) and short windows: the five took ~150 s on one GPU, mostly the
# start of each row's processes.
BENCH_CUDA = ["--strategies", "single,ddp+bf16-mixed", "--world-sizes", "1", "--warmup", "2",
              "--steps", "5", "--repeats", "2"]
# The plan's bench job on CUDA: warm windows (the GPU's clocks and caches settled) long
# enough that a ~1 ms ConvNet step is not timed over a handful of steps.
PLAN_CUDA = ["--warmup", "10", "--steps", "20", "--repeats", "3"]
TINY_GPT = ["--accelerator", "cpu", "--layers", "1", "--width", "32", "--seq-len", "16",
            "--batch-size", "2", "--warmup", "1", "--steps", "2", "--compile-backend", "eager"]
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
    if not ctx.dry_run:
        argv += BENCH_CUDA
    else:
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
        else:
            argv += PLAN_CUDA
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


def gpt(ctx: Context) -> Outcome:
    """GPT-2 small (124M): Run eager, Run compile=True and raw torch.compile, one process."""
    path = _fresh(ctx.workdir / "gpt.json")
    argv = [PY, "benchmarks/gpu_check_gpt.py", "--json", str(path)]
    if ctx.dry_run:
        # The eager backend walks the compile path without minutes of CPU code generation;
        # a nominal 1 TFLOP/s peak makes the MFU column computed.
        argv += [*TINY_GPT, "--peak-flops", "1e12"]
    else:
        argv += ["--warmup", "3", "--steps", "15"]
    result = ctx.run(argv, "gpt")
    data = _json(path) or {}
    rows = data.get("rows", [])
    notes = _model_note(data, ctx.dry_run)
    missing = {"eager", "compile", "raw+compile"} - {r["variant"] for r in rows}
    if missing:
        notes.append(f"missing variant(s): {', '.join(sorted(missing))}")
    untraced = [r["variant"] for r in rows if r.get("compiled") and not r.get("traced")]
    if untraced:
        notes.append(f"nothing was compiled in {', '.join(untraced)}: no module ran under "
                     "a Dynamo trace (torch.compiler.is_compiling() never True)")
    pairs = (("compile", "eager"), ("raw+compile", "eager"), ("compile", "raw+compile"))
    shown = [f"{a} / {b} = {x:.2f}x" for a, b in pairs if (x := ratio(rows, a, b))]
    if shown:
        notes.append("tokens/s: " + "; ".join(shown))
    ok = result.ok and not missing and all(row_ok(r) for r in rows)
    return Outcome(ok, gpt_table(rows) if rows else "", notes)


def float8(ctx: Context) -> Outcome:
    """float8 vs bf16-mixed, both compiled, on a ~0.9B GPT (16 x 2048, batch 8 x 1024)."""
    path = _fresh(ctx.workdir / "float8.json")
    argv = [PY, "benchmarks/gpu_check_gpt.py", "--json", str(path),
            "--variants", "bf16-mixed+compile", "float8+compile"]
    argv += [*TINY_GPT, "--peak-flops", "1e12"] if ctx.dry_run else \
        ["--layers", "16", "--width", "2048", "--batch-size", "8", "--warmup", "3",
         "--steps", "10"]
    result = ctx.run(argv, "float8")
    data = _json(path) or {}
    if data.get("skipped"):
        return Outcome(result.ok, skipped=f"float8 skipped: {data['skipped']}")
    rows = data.get("rows", [])
    notes = _model_note(data, ctx.dry_run)
    x = ratio(rows, "float8+compile", "bf16-mixed+compile")
    ok = result.ok and x is not None and all(row_ok(r) for r in rows)
    if x is None:
        notes.append("missing variant(s): both bf16-mixed+compile and float8+compile must run")
    else:
        notes.append(f"float8 / bf16-mixed = {x:.2f}x tokens/s (target {FLOAT8_TARGET}x"
                     + (", not applied in a dry run)" if ctx.dry_run else ")"))
        ok = ok and (ctx.dry_run or x >= FLOAT8_TARGET)
    return Outcome(ok, gpt_table(rows) if rows else "", notes)


def cudagraphs(ctx: Context) -> Outcome:
    """``gpu_peers.py`` on the ConvNet, batch 64: raw, Accelerate, Fabric, paratrain eager
    and paratrain with CUDA graphs (``compile={"mode": "reduce-overhead"}``)."""
    path = _fresh(ctx.workdir / "cudagraphs.json")
    if ctx.dry_run:  # random tokens: no Fashion-MNIST files needed for the plumbing
        job, flags = "gpt", ["--accelerator", "cpu", "--variants", "paratrain",
                             "paratrain+cudagraphs", "--repeats", "1", "--warmup", "1",
                             "--steps", "1", "--samples", "16", "--batch-size", "4",
                             "--seq-len", "16", "--gpt-layers", "1", "--gpt-width", "32",
                             "--compile-backend", "eager"]
    else:
        job, flags = "convnet", ["--accelerator", "cuda", "--variants", "raw", "accelerate",
                                 "fabric", "paratrain", "paratrain+cudagraphs", "--repeats",
                                 "1", "--warmup", "10", "--steps", "200"]
    result = ctx.run([PY, "benchmarks/gpu_peers.py", "--jobs", job, "--json", str(path),
                      *flags], "cudagraphs")
    # gpu_peers prints two tables (peers, then compiled vs eager): a blank line apart.
    table = "\n".join(line if line.startswith("|") else "" for line in result.output.splitlines()
                      if line.startswith("|") or not line.strip()).strip()
    table = "\n\n".join(part for part in table.split("\n\n") if part.strip())
    notes = [line for line in result.output.splitlines() if line.startswith("skipping")]
    found = [r["ratio"] for r in (_json(path) or {}).get("vs_paratrain", [])
             if r["job"] == job and r["variant"] == "paratrain+cudagraphs"]
    ok = result.ok and bool(found)
    if not found:
        notes.append(f"{job}: no CUDA graphs vs eager ratio (exit {result.returncode})")
    else:
        notes.append(f"CUDA graphs / eager = {found[0]:.2f}x samples/s (target "
                     f"{CUDA_GRAPHS_TARGET}x" + (", not applied in a dry run; CPU: no CUDA "
                                                 "graphs" if ctx.dry_run else "") + ")")
        ok = ok and (ctx.dry_run or found[0] >= CUDA_GRAPHS_TARGET)
    if not ctx.dry_run:
        notes.append("1 repeat of 200 steps after 10 per variant (budget); the full "
                     "comparison, ResNet-18 and GPT too, is `python benchmarks/gpu_peers.py`")
    return Outcome(ok, table, notes)


def _model_note(data: dict[str, Any], dry_run: bool) -> list[str]:
    if not data:
        return []
    model, peak = data["model"], data["peak_flops"]
    size = f", {model['parameters'] / 1e6:,.1f}M parameters" if "parameters" in model else ""
    return [f"GPT {model['n_layer']} x {model['n_embd']} ({model['n_head']} heads, vocab "
            f"{model['vocab_size']}{size}), {data['precision']} on {data['device']}; peak "
            f"{'n/a' if peak is None else f'{peak / 1e12:.1f} TFLOP/s'}"
            + (" (nominal, dry run)" if dry_run else "")]


SECTIONS = (  # 450 s together: under 8 minutes with the kill grace and the report
    Section("gpu_tests", "gpu test tier (tests/gpu)", 100, gpu_tests),
    Section("bench", "paratrain bench: single, ddp+bf16-mixed", 55, bench),
    Section("plan", "plan vs bench, ConvNet and ResNet-18", 50, plan_vs_bench),
    Section("gpt", "GPT-2 small: compile vs eager vs raw torch.compile", 80, gpt),
    Section("float8", "float8 vs bf16-mixed, compiled, ~0.9B GPT", 105, float8),
    Section("cudagraphs", "ConvNet batch 64: CUDA graphs vs eager, peers", 60, cudagraphs),
)
