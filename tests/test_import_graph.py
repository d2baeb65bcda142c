"""The package's import graph, read from the source (top-level imports; what a
``TYPE_CHECKING`` block names is left out, as it never runs). Imports sit at the top of
modules (ruff's PLC0415), so this graph is the one Python walks at import time:

- no module takes part in an import cycle;
- two packages import each other only where one is ``config``: a component's recipe
  section lives beside the component and builds on ``config.schema``, while
  ``config.recipe`` composes the sections."""

from __future__ import annotations

import ast
from pathlib import Path

import asyncrl

ROOT = Path(asyncrl.__file__).parent


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def import_graph() -> dict[str, set[str]]:
    """Module → the asyncrl modules its top level imports."""
    files = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.If) and _type_checking(node):
                continue
            body = node.body if isinstance(node, ast.If | ast.Try) else [node]
            for stmt in body:
                if isinstance(stmt, ast.ImportFrom) and (stmt.module or "").startswith("asyncrl"):
                    deps.add(stmt.module or "")
                    deps.update(f"{stmt.module}.{a.name}" for a in stmt.names)
                elif isinstance(stmt, ast.Import):
                    deps.update(a.name for a in stmt.names if a.name.startswith("asyncrl"))
        graph[name] = {d for d in deps if d in files and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
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


def test_no_module_is_in_an_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 100  # the whole package was read
    assert cycles(graph) == []


def test_packages_import_each_other_only_through_config() -> None:
    graph = import_graph()

    def package(module: str) -> str:
        return ".".join(module.split(".")[:2])

    edges = {(package(m), package(d)) for m, deps in graph.items() for d in deps}
    mutual = {tuple(sorted(e)) for e in edges if e[0] != e[1] and e[::-1] in edges}
    assert {p for p in mutual if "asyncrl.config" not in p} == set()


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
