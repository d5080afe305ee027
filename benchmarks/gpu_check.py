"""One-command GPU proof: gpu tests, bench, plan, compile, float8, CUDA graphs; one report.

    make gpu-check                                   # = python3 benchmarks/gpu_check.py
    python benchmarks/gpu_check.py --report out.md --budget float8=150
    python benchmarks/gpu_check.py --dry-run         # every section tiny on CPU (plumbing)

Sections run one after the other as child processes, each under its own time budget
(killed with everything they started when it runs out), so a failed or hung section is
FAIL and the later ones still run. All sections get ``--total-budget`` seconds (default
450: with the kill grace of stopped commands and the report, under 8 minutes; a dry run
gets three times the defaults). A section that cannot apply here (float8 without torchao
or below sm_89) is SKIP with its one-line reason and does not fail the check. The
markdown report holds the device, torch/CUDA versions, and per section the commands, the
table, the wall time and PASS/FAIL/SKIP. Exit status: 0 when no section failed, 1
otherwise, 2 without CUDA (one line) or on a bad flag. What each section runs is in
``gpu_check_sections.py``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = ("gpu-check: no CUDA device visible (torch.cuda.is_available() is False); "
           "run it on a GPU machine, or pass --dry-run for a tiny CPU run of every section")
TOTAL_BUDGET_S = 450.0
DRY_RUN_BUDGET_FACTOR = 3  # the budgets are for a GPU; a loaded CPU is slower at tiny sizes
KILL_GRACE_S = 3.0
TAIL_LINES = 25


@dataclass
class CommandResult:
    """One child command: its exit status (None: never started) and where its output went."""

    argv: list[str]
    returncode: int | None
    seconds: float
    output: str
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


@dataclass
class Outcome:
    """What a section function returns: passed or not, its table, remarks for the report;
    ``skipped``: why the section does not apply here (one line), or None."""

    ok: bool
    table: str = ""
    notes: list[str] = field(default_factory=list)
    skipped: str | None = None


@dataclass
class Context:
    """What a section function gets: the mode, a folder for its files, and a deadline that
    every command it runs through :meth:`run` is killed at."""

    dry_run: bool
    workdir: Path
    deadline: float  # time.monotonic() value
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    commands: list[CommandResult] = field(default_factory=list)

    def run(self, argv: list[str], log_name: str) -> CommandResult:
        """Run ``argv`` in the repository with what is left of the budget; output to a log."""
        started = time.monotonic()
        left = self.deadline - started
        log = self.workdir / f"{log_name}.log"
        log.write_text("" if left > 0 else "not started: the section's budget is spent\n")
        proc, timed_out = None, left <= 0
        if left > 0:
            with open(log, "w") as out:
                # Its own session, so that a timeout can kill the whole tree (bench and plan
                # start launchers whose workers would otherwise keep the GPU).
                proc = subprocess.Popen(argv, cwd=REPO, env=self.env, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    proc.wait(timeout=left)
                except subprocess.TimeoutExpired:
                    timed_out = True
                    kill_tree(proc)
        result = CommandResult(argv, None if proc is None else proc.returncode,
                               time.monotonic() - started,
                               log.read_text(errors="replace"), timed_out)
        self.commands.append(result)
        return result


def kill_tree(proc: subprocess.Popen) -> None:
    """Stop the command and everything it started, SIGKILL after a short grace.

    torchrun's workers run in sessions of their own, so bench's ``kill_tree`` finds them
    by parenthood; whatever was orphaned before that still shares the command's group.
    """
    from paratrain.bench.jobs import kill_tree as kill_descendants

    kill_descendants(proc, grace=KILL_GRACE_S)
    with suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


@dataclass(frozen=True)
class Section:
    """A named step of the check with its time budget (seconds)."""

    name: str
    title: str
    budget_s: float
    run: Callable[[Context], Outcome]


@dataclass
class SectionResult:
    name: str
    title: str
    passed: bool
    seconds: float
    budget_s: float
    table: str
    notes: list[str]
    commands: list[CommandResult]
    skipped: str | None = None

    @property
    def status(self) -> str:
        if not self.passed:
            return "FAIL"
        return "SKIP" if self.skipped else "PASS"


def run_section(section: Section, *, budget_s: float, dry_run: bool, workdir: Path,
                env: dict[str, str] | None = None) -> SectionResult:
    """Run one section under ``budget_s``; an exception or a timed-out command is a FAIL."""
    started = time.monotonic()
    ctx = Context(dry_run=dry_run, workdir=workdir, deadline=started + budget_s,
                  env=dict(os.environ if env is None else env))
    try:
        outcome = section.run(ctx) if budget_s > 0 else Outcome(
            False, notes=["not run: the total budget was spent by earlier sections"])
    except Exception as exc:  # one section's bug must not stop the others
        outcome = Outcome(False, notes=[f"section raised {type(exc).__name__}: {exc}"])
    seconds = time.monotonic() - started
    notes = list(outcome.notes) + ([outcome.skipped] if outcome.skipped else [])
    for c in ctx.commands:
        if c.timed_out:
            notes.append(f"`{display(c.argv)}` was stopped: the section's {budget_s:.0f} s "
                         f"budget ran out after {c.seconds:.0f} s")
    over = seconds > budget_s + KILL_GRACE_S
    if over:
        notes.append(f"took {seconds:.0f} s, over its {budget_s:.0f} s budget")
    passed = outcome.ok and not over and not any(c.timed_out for c in ctx.commands)
    return SectionResult(section.name, section.title, passed, seconds, budget_s,
                         outcome.table, notes, ctx.commands, outcome.skipped)


def run_sections(sections: list[Section], *, dry_run: bool, workdir: Path,
                 total_budget_s: float = TOTAL_BUDGET_S,
                 env: dict[str, str] | None = None) -> list[SectionResult]:
    """Every section in order, each under min(its budget, what is left of the total)."""
    end = time.monotonic() + total_budget_s
    results = []
    for i, section in enumerate(sections, 1):
        budget = max(0.0, min(section.budget_s, end - time.monotonic()))
        print(f"gpu-check: [{i}/{len(sections)}] {section.title} (budget {budget:.0f} s)",
              flush=True)
        result = run_section(section, budget_s=budget, dry_run=dry_run, workdir=workdir,
                             env=env)
        print(f"gpu-check: [{i}/{len(sections)}] {section.name}: {result.status} in "
              f"{result.seconds:.1f} s", flush=True)
        results.append(result)
    return results


def display(argv: list[str]) -> str:
    """The command as one shell line, the interpreter shown by its name."""
    shown = [Path(argv[0]).name if argv and argv[0] == sys.executable else argv[0], *argv[1:]]
    return shlex.join(shown)


def environment(*, dry_run: bool) -> dict[str, str]:
    """Device, versions and commit for the report's header."""
    import torch

    import paratrain

    info = {"python": f"{platform.python_version()} ({sys.executable})",
            "torch": torch.__version__, "paratrain": getattr(paratrain, "__version__", "?")}
    if dry_run:
        info["device"] = "cpu (dry run: tiny sizes, CUDA hidden from the sections)"
    else:
        info["device"] = f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)"
        info["CUDA"] = str(torch.version.cuda)
        info["cuDNN"] = str(torch.backends.cudnn.version())
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                                capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, text=True,
                               capture_output=True, timeout=10).stdout.strip()
        info["commit"] = (commit + (" (with uncommitted changes)" if dirty else "")) or "?"
    except (OSError, subprocess.SubprocessError):
        info["commit"] = "? (no git)"
    return info


def format_report(results: list[SectionResult], info: dict[str, str], *, command: str,
                  dry_run: bool, total_s: float) -> str:
    """The whole report as markdown: header, summary table, one part per section."""
    passed = sum(r.passed for r in results)
    skipped = sum(r.status == "SKIP" for r in results)
    verdict = "PASS" if passed == len(results) else "FAIL"
    lines = ["# paratrain GPU check", "",
             f"**{verdict}**: {passed} of {len(results)} sections passed"
             + (f" ({skipped} skipped)" if skipped else "")
             + f", {total_s:.0f} s in all ({time.strftime('%Y-%m-%d %H:%M:%S %Z')}).", ""]
    if dry_run:
        lines += ["Dry run on CPU: every section ran at a tiny size to check the plumbing; "
                  "no number here says anything about a GPU.", ""]
    lines += ["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in info.items()),
              f"| command | `{command}` |", "",
              "| section | result | wall time (s) | budget (s) |", "|---|---|---:|---:|"]
    lines += [f"| {r.title} | {r.status} | {r.seconds:.1f} | {r.budget_s:.0f} |"
              for r in results]
    for i, r in enumerate(results, 1):
        lines += ["", f"## {i}. {r.title}: {r.status}", "",
                  f"Wall time {r.seconds:.1f} s of a {r.budget_s:.0f} s budget.", ""]
        if r.commands:
            lines += ["```console", *(f"$ {display(c.argv)}   # exit "
                                      f"{'-' if c.returncode is None else c.returncode}, "
                                      f"{c.seconds:.1f} s" for c in r.commands), "```", ""]
        if r.table:
            lines += [r.table, ""]
        lines += [f"- {n}" for n in r.notes]
        for c in r.commands:
            if not c.ok and c.output.strip():
                tail = c.output.strip().splitlines()[-TAIL_LINES:]
                lines += ["", f"Last lines of `{display(c.argv)}`:", "", "```text", *tail, "```"]
    return "\n".join(lines).rstrip() + "\n"


def parse_budgets(items: list[str], names: list[str]) -> dict[str, float]:
    """``NAME=SECONDS`` items as a dict; ValueError (one line) on a bad one."""
    budgets = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            seconds = float(value)
        except ValueError:
            seconds = -1.0
        if name not in names or seconds <= 0:
            raise ValueError(f"--budget {item!r}: expected NAME=SECONDS with NAME one of "
                             f"{', '.join(names)} and SECONDS > 0")
        budgets[name] = seconds
    return budgets


def main(argv: list[str] | None = None) -> int:
    from gpu_check_sections import SECTIONS

    names = [s.name for s in SECTIONS]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--report", default="gpu-check-report.md", help="markdown report path")
    p.add_argument("--dry-run", action="store_true", help="every section tiny, on CPU")
    p.add_argument("--sections", nargs="+", choices=names, default=names)
    p.add_argument("--budget", action="append", default=[], metavar="NAME=SECONDS",
                   help="replace a section's budget (defaults: " + ", ".join(
                       f"{s.name}={s.budget_s:.0f}" for s in SECTIONS) + ")")
    p.add_argument("--total-budget", type=float, default=None,
                   help=f"seconds for all sections (default {TOTAL_BUDGET_S:.0f})")
    p.add_argument("--workdir", help="logs and JSON of every command (default: a new temp dir)")
    args = p.parse_args(argv)
    try:
        budgets = parse_budgets(args.budget, names)
        if not Path(args.report).resolve().parent.is_dir():
            raise ValueError(f"--report: directory of {args.report!r} does not exist")
    except ValueError as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 2
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print(NO_CUDA, file=sys.stderr)
        return 2
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpu-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.dry_run:
        env |= {"CUDA_VISIBLE_DEVICES": "", "PARATRAIN_ACCELERATOR": "cpu"}
    factor = DRY_RUN_BUDGET_FACTOR if args.dry_run else 1
    sections = [Section(s.name, s.title, budgets.get(s.name, s.budget_s * factor), s.run)
                for s in SECTIONS if s.name in args.sections]
    started = time.monotonic()
    results = run_sections(sections, dry_run=args.dry_run, workdir=workdir,
                           total_budget_s=args.total_budget or TOTAL_BUDGET_S * factor, env=env)
    command = display([sys.executable, "benchmarks/gpu_check.py",
                       *(argv if argv is not None else sys.argv[1:])])
    info = environment(dry_run=args.dry_run) | {"logs": str(workdir)}
    Path(args.report).write_text(format_report(results, info, command=command,
                                               dry_run=args.dry_run,
                                               total_s=time.monotonic() - started))
    failed = [r.name for r in results if not r.passed]
    print(f"gpu-check: report in {args.report}; "
          + (f"FAIL: {', '.join(failed)}" if failed else "every section passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    # Run the module by name: gpu_check_sections imports it, and one copy of its
    # classes must serve both.
    from gpu_check import main as _main
    sys.exit(_main())
