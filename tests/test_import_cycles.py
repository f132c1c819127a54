"""mpguide's modules import each other in one direction: no cycle among them, counting the
imports inside functions, and nothing in ``mpguide.core`` imports a chapter.

The graph is read from the source with ``ast`` (nothing is imported): an edge A -> B for every
``import``/``from ... import`` in A that names B or something inside B, wherever it stands. A
package's ``__init__`` is a module like the others; ``from pkg import name`` counts as an edge to
``pkg.name`` where that is a module, else to ``pkg``.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT


def _modules(root: Path = ROOT) -> dict[str, Path]:
    """The modules of the ``mpguide`` package under ``root``, by dotted name."""
    found = {}
    for path in sorted((root / "mpguide").rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    base = package[: len(package) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's mpguide imports, anywhere in its source (functions included)."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                origin = _absolute(module, path, node)
                targets = [
                    f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin
                    for a in node.names
                ]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_reader_finds_a_planted_cycle(tmp_path):
    pkg = tmp_path / "mpguide" / "sub"
    pkg.mkdir(parents=True)
    (tmp_path / "mpguide" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from mpguide.sub import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("import mpguide.sub.a\n")
    graph = import_graph(_modules(tmp_path))
    assert cycles(graph) == [["mpguide.sub.a", "mpguide.sub.b"]]


def test_no_import_cycles_among_mpguide_modules():
    found = cycles(import_graph(_modules()))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_core_imports_no_chapter():
    graph = import_graph(_modules())
    upward = {
        (module, target)
        for module, targets in graph.items()
        if module.startswith("mpguide.core")
        for target in targets
        if not target.startswith("mpguide.core") and target != "mpguide"
    }
    assert not upward, f"mpguide.core imports a chapter: {sorted(upward)}"
