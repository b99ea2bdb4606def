"""The package's structure: no import cycles, the contract at the bottom, methods loaded only when asked for.

The import graph is read from the source (every `import` and `from ... import`, function-local ones included, since
those run too; `if TYPE_CHECKING:` blocks left out, since they never run), one node per module.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "hf_spec"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The hf_spec modules `tree` imports: `from a.b import c` names `a.b.c` where that is a module, else `a.b`."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "hf_spec")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            if base.split(".")[0] == "hf_spec":
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    found.add(sub if sub in known else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    # importing `a.b.c` runs the `__init__` of `a.b` first (the root package's facade aside): a circle through a
    # package's `__init__` fails at import time as any other does
    parents = {".".join(m.split(".")[:i]) for m in found for i in range(2, len(m.split(".")))}
    found |= parents
    found.discard(module)
    return {m for m in found if m in known and not module.startswith(m + ".")}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {
        name: _imports(ast.parse(path.read_text()), name, path.name == "__init__.py", known)
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_import_cycles():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    """Negative control: a two-module circle and a function-local import that closes one are both found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": set()}
    assert _cycles(graph) == [["a", "b"]]
    local = ast.parse("def f():\n    from hf_spec.x import y\n")
    assert _imports(local, "hf_spec.z", False, {"hf_spec.x", "hf_spec.z"}) == {"hf_spec.x"}
    typing_only = ast.parse("if TYPE_CHECKING:\n    from hf_spec.x import y\n")
    assert _imports(typing_only, "hf_spec.z", False, {"hf_spec.x", "hf_spec.z"}) == set()


# the floors, bottom up: a module may import its own floor and those below it, never one above
FLOORS = [
    ("hf_spec.tree",),
    ("hf_spec.core",),
    ("hf_spec.io", "hf_spec.kernels", "hf_spec.engine"),
]


def _floor(module: str) -> int | None:
    for level, prefixes in enumerate(FLOORS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return None


@pytest.mark.parametrize("floor", range(len(FLOORS) - 1))
def test_lower_floors_never_import_upward(floor):
    """`tree` imports nothing of hf_spec's, `core` only `tree`: the contract sits at the bottom."""
    graph = import_graph()
    upward = [
        f"{m} -> {t}"
        for m, targets in graph.items()
        if _floor(m) == floor
        for t in targets
        if _floor(t) is None or _floor(t) > floor
    ]
    assert not upward, upward


def _imported_by(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, cwd=REPO, check=True,
    )  # fmt: skip
    return [m for m in out.stdout.split() if m.startswith("hf_spec")]


def test_the_engine_imports_no_method():
    loaded = _imported_by("import hf_spec.engine.round")
    assert not [m for m in loaded if m.startswith(("hf_spec.methods.", "hf_spec.heads", "hf_spec.training"))]


def test_one_method_imports_no_other():
    loaded = _imported_by("from hf_spec import get_method\nget_method('pld')")
    methods = {m.split(".")[2] for m in loaded if m.startswith("hf_spec.methods.")}
    assert methods == {"pld"}, methods
