"""The package layout shows the architecture: no import cycles, no prefix families,
and the library never imports the test helpers."""

import ast
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "paratrain"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def import_graph() -> dict[str, set[str]]:
    """Module -> paratrain modules it imports (at any depth, lazy and ``TYPE_CHECKING``
    imports included: a cycle hidden behind either is still a cycle in the design)."""
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            for target in targets:
                if target in modules and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycles():
    assert _cycles(import_graph()) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_library_never_imports_the_test_helpers():
    offenders = {m: sorted(t for t in targets if t.startswith("paratrain.testing"))
                 for m, targets in import_graph().items() if not m.startswith("paratrain.testing")}
    assert {m: t for m, t in offenders.items() if t} == {}


def test_no_prefix_families_in_one_folder():
    """``plan_model.py`` beside ``plan_report.py`` means a package is missing."""
    problems = []
    for folder in {p.parent for p in PACKAGE.rglob("*.py")}:
        stems = [p.stem for p in folder.glob("*.py") if p.stem != "__init__"]
        prefixes = defaultdict(list)
        for stem in stems:
            prefixes[stem.split("_")[0]].append(stem)
        problems += [f"{folder.relative_to(SRC)}: {sorted(group)}"
                     for group in prefixes.values() if len(group) > 1]
    assert problems == []


def test_no_module_over_400_lines():
    long = {str(p.relative_to(SRC)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def test_tests_mirror_the_packages():
    """Each library package has its own test folder."""
    tests = Path(__file__).resolve().parent
    packages = {p.parent.name for p in PACKAGE.glob("*/__init__.py")} - {"testing"}
    missing = sorted(name for name in packages if not (tests / name).is_dir())
    assert missing == []
