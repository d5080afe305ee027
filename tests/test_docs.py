"""The documentation's code agrees with the code.

Every ```python block of README.md and docs/*.md is compiled, and every call it
makes to ``Run(...)`` or ``run.<method>(...)`` is checked against the real
signatures; so are the inline spans such as `run.save(directory)`. The blocks
then run as written, each as a ``__main__`` module of its own in a temporary directory
(its own imports, nothing given to it, no launcher variables), unless the line before
them is a marker:

* ``<!-- no-run: why -->``: a fragment, or it needs a launcher, a GPU, a cluster,
  a server or minutes;
* ``<!-- after: file.py -->``: the block is a script of tests/porting/, run there.

Those are skipped with their reason, so pytest's summary counts the blocks that ran and
those that did not. Fashion-MNIST is replaced by a few random images so the README's
example runs in seconds.

A block runs on a one-rank worker of the persistent test pool
(``paratrain.testing.pool.run_script``: torch already imported, the environment, working
directory, random streams and torch settings of a fresh interpreter), which saves an
interpreter start and a torch import per block. A block that starts processes of its own
runs in a fresh interpreter instead (a pool worker cannot have children).
"""

from __future__ import annotations

import ast
import inspect
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass, fields
from pathlib import Path

import pytest

import paratrain
from paratrain.config import RunConfig
from paratrain.distributed.spawn import WorkerFailed
from paratrain.strategies import available_strategies, strategy_class
from paratrain.testing.pool import run_script

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?^```python\n(.*?)^```", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+\([^`\n]*\))`")
RUN_KEYWORDS = {f.name for f in fields(RunConfig)} | {"environ"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    marker: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"

    @property
    def runs(self) -> bool:
        return not self.marker.startswith(("<!-- no-run", "<!-- after:"))


def blocks() -> list[Block]:
    found = []
    for path in DOCS:
        text = path.read_text()
        for match in BLOCK.finditer(text):
            line = text.count("\n", 0, match.start(2))
            found.append(Block(path, line, match.group(1) or "", match.group(2)))
    return found


def _is_run_constructor(func: ast.expr) -> bool:
    return (isinstance(func, ast.Name) and func.id == "Run") or (
        isinstance(func, ast.Attribute) and func.attr == "Run"
        and isinstance(func.value, ast.Name) and func.value.id == "paratrain")


def call_problems(tree: ast.AST) -> list[str]:
    """Keywords of ``Run(...)`` and ``run.method(...)`` calls that the code does not accept."""
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        keywords = {k.arg for k in node.keywords if k.arg is not None}
        if _is_run_constructor(node.func):
            problems += [f"Run(... {k}=...): no such RunConfig field"
                         for k in sorted(keywords - RUN_KEYWORDS)]
            strategy = next((k.value for k in node.keywords if k.arg == "strategy"), None)
            if isinstance(strategy, ast.Constant) and strategy.value not in (
                    "auto", *available_strategies()):
                problems.append(f"Run(strategy={strategy.value!r}): no such strategy")
        elif (isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
              and node.func.value.id == "run"):
            method = getattr(paratrain.Run, node.func.attr, None)
            if method is None:
                continue  # an instance attribute (run.strategy, ...): checked below
            params = inspect.signature(method).parameters
            if any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            problems += [f"run.{node.func.attr}({k}=...): no such parameter"
                         for k in sorted(keywords - set(params))]
    return problems


def attribute_problems(tree: ast.AST, run: paratrain.Run) -> list[str]:
    """``run.<name>`` uses where a Run has no such attribute."""
    names = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
             and isinstance(node.value, ast.Name) and node.value.id == "run"}
    return [f"run.{name}: no such attribute" for name in sorted(names)
            if not hasattr(run, name)]


@pytest.fixture(scope="module")
def a_run():
    with paratrain.Run(accelerator="cpu", progress=False) as run:
        yield run


@pytest.mark.parametrize("block", blocks(), ids=lambda b: b.id)
def test_block_compiles_and_calls_real_signatures(block, a_run):
    tree = ast.parse(block.code, filename=block.id)
    problems = call_problems(tree) + attribute_problems(tree, a_run)
    assert not problems, f"{block.id}: {problems}"


def test_inline_calls_use_real_signatures(a_run):
    problems = []
    for path in DOCS:
        for line_number, line in enumerate(path.read_text().splitlines(), 1):
            for span in INLINE.findall(line):
                if "run." not in span and "Run(" not in span:
                    continue
                # Prose elides values: `run.loader(dataset, batch_size=..)`.
                code = re.sub(r"\.\.\.?(?=[,)])", "None", span.strip())
                try:
                    tree = ast.parse(code)
                except SyntaxError:
                    continue  # not a call, e.g. `paratrain launch ... train.py`
                problems += [f"{path.name}:{line_number}: {p}" for p in
                             call_problems(tree) + attribute_problems(tree, a_run)]
    assert not problems, problems


def test_the_checker_finds_drift(a_run):
    tree = ast.parse("run = paratrain.Run(strategy='zero3', nope=1)\nrun.save(dir=None)\nrun.fit()")
    assert call_problems(tree) + attribute_problems(tree, a_run) == [
        "Run(... nope=...): no such RunConfig field", "Run(strategy='zero3'): no such strategy",
        "run.save(dir=...): no such parameter", "run.fit: no such attribute"]


def test_getting_started_lists_every_field_and_strategy():
    (block,) = [b for b in blocks() if b.path.name == "getting-started.md"][:1]
    call = next(n for n in ast.walk(ast.parse(block.code))
                if isinstance(n, ast.Call) and _is_run_constructor(n.func))
    assert {k.arg for k in call.keywords} == RUN_KEYWORDS - {"environ"}
    listed = set(re.findall(r"[\w-]+", block.code.split("strategy=", 1)[1].split("\n")[0]))
    assert {"auto", *available_strategies()} <= listed
    options = next(k.value for k in call.keywords if k.arg == "strategy_options")
    strategy = next(k.value.value for k in call.keywords if k.arg == "strategy")
    known = {f.name for f in fields(strategy_class(strategy).Options)}
    assert {k.value for k in options.keys} <= known


# Each runnable block is a script of its own, in a temporary folder, with nothing imported
# for it and no launcher variables (a pool rank has them). Only Fashion-MNIST is swapped
# for 16 random images, and put back after the block (a pool worker runs other tests next).
PRELUDE = """
import os
import runpy
import sys

import paratrain.datasets

for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "GROUP_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT"):
    os.environ.pop(name, None)


def tiny_fashion_mnist(split="train", **_):
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0 if split == "train" else 1)
    return TensorDataset(torch.rand(16, 1, 28, 28, generator=g),
                         torch.randint(0, 10, (16,), generator=g))


real_fashion_mnist = paratrain.datasets.fashion_mnist
paratrain.datasets.fashion_mnist = tiny_fashion_mnist
try:
    # A module of its own, named __main__: the block sees only what it imports, and
    # functions it defines can be pickled for spawned processes.
    runpy.run_path(sys.argv[1], run_name="__main__")
finally:
    paratrain.datasets.fashion_mnist = real_fashion_mnist
"""
BLOCK_TIMEOUT_S = 120


def starts_processes(block: Block) -> bool:
    """Blocks that start ranks of their own: a pool worker (a daemon) cannot, so they get a
    fresh interpreter. ``paratrain.verify`` replays the run on spawned ranks."""
    return "paratrain.verify" in block.code


def skip_reason(block: Block) -> str | None:
    """Why a block does not run here: its marker, or None."""
    if block.marker.startswith("<!-- no-run"):
        return block.marker[len("<!-- no-run"):].strip(" :->") or "no-run"
    if block.marker.startswith("<!-- after:"):
        return f"runs in tests/porting as {block.marker[len('<!-- after:'):].strip(' ->')}"
    return None


def test_blocks_are_counted(capsys):
    """How many blocks run here and how many are skipped, by reason (shown with -s)."""
    reasons = [skip_reason(b) for b in blocks()]
    ran = sum(r is None for r in reasons)
    with capsys.disabled():
        print(f"\ndocs python blocks: {ran} run, {len(reasons) - ran} skipped "
              f"({sum(r is not None and r.startswith('runs in') for r in reasons)} run in "
              "tests/porting, the others marked no-run)")
    assert ran >= 12  # a block that stops running must be marked, and counted here


@pytest.mark.slow
@pytest.mark.parametrize("block", blocks(), ids=lambda b: b.id)
def test_block_runs_as_written(block, tmp_path, monkeypatch):
    reason = skip_reason(block)
    if reason is not None:
        pytest.skip(f"{block.id}: {reason}")
    script = tmp_path / f"{block.path.stem}_{block.line}.py"
    script.write_text(textwrap.dedent(block.code))
    env = {"PYTHONPATH": str(ROOT / "src"), "WANDB_MODE": "offline",
           "WANDB_SILENT": "true", "PARATRAIN_ACCELERATOR": "cpu"}
    if starts_processes(block):
        try:
            done = subprocess.run([sys.executable, "-c", PRELUDE, str(script)],
                                  cwd=tmp_path, env={**os.environ, **env}, capture_output=True,
                                  text=True, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{block.id} ran over {BLOCK_TIMEOUT_S} s")
    else:
        prelude = tmp_path / "prelude.py"
        prelude.write_text(PRELUDE)
        monkeypatch.chdir(tmp_path)  # the rank runs in the caller's working directory
        try:
            (done,) = run_script(str(prelude), str(script), nproc=1, env=env,
                                 timeout=BLOCK_TIMEOUT_S)
        except WorkerFailed as exc:  # a timeout or a dead worker
            pytest.fail(f"{block.id}: {exc}")
    assert done.returncode == 0, f"{block.id} exited {done.returncode}:\n{done.stderr[-3000:]}"
