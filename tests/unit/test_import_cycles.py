"""No import cycle among the modules of src/draftforge, counting module-level imports only (imports inside
functions are deferred on purpose: plugin hooks, torch-heavy paths). Read with `ast`, nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name → file, for every .py under root (a package's __init__ is the package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _top_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Import statements run at import time: the module body and its top-level if / try blocks, but not
    function or class bodies, nor `if TYPE_CHECKING:` blocks."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                found += _top_level_imports(node.body) + _top_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            found += _top_level_imports(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                found += _top_level_imports(handler.body)
    return found


def import_graph(root: Path, prefix: str) -> dict[str, set[str]]:
    """module → the modules under `prefix` it imports at module level (the named module, not its parents)."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {m: set() for m in modules if m == prefix or m.startswith(prefix + ".")}
    for name in graph:
        path = modules[name]
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _top_level_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                # `from pkg import sub` imports the submodule; `from pkg import name` the package itself. Parent
                # packages Python runs first are not edges (a package re-exporting its children is no cycle).
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in graph else base for a in node.names]
            graph[name] |= {t for t in targets if t in graph and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle_in_draftforge():
    graph = import_graph(SRC, "draftforge")
    assert len(graph) > 50 and graph["draftforge.drafter.dspark"] >= {"draftforge.drafter.config", "draftforge.drafter.model"}
    assert cycles(graph) == []


def test_the_checker_finds_a_cycle_and_ignores_deferred_imports(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import x\n")
    (pkg / "b.py").write_text("try:\n    from . import c\nexcept ImportError:\n    pass\nx = 1\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("def f():\n    from pkg import a\n")  # deferred: not an edge
    (pkg / "e.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    graph = import_graph(tmp_path, "pkg")
    assert graph["pkg.d"] == set() and graph["pkg.e"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
