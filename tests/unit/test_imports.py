"""The package's import graph: imports flow one way (docs/architecture.md), so no cycle.

Every `from .x import` / `from cachefs.x import` counts, those under TYPE_CHECKING too: a
type-only import back up is still a dependency on the module above."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "cachefs"


def import_graph() -> dict[str, set[str]]:
    mods = {p.stem for p in PKG.glob("*.py")}
    graph = {}
    for m in mods:
        deps = set()
        for node in ast.walk(ast.parse((PKG / f"{m}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level == 1:
                    deps |= {node.module} if node.module else {a.name for a in node.names}
                elif (node.module or "").startswith("cachefs."):
                    deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps |= {a.name.split(".")[1] for a in node.names
                         if a.name.startswith("cachefs.")}
        graph[m] = (deps & mods) - {m}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}            # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_find_cycle_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_cachefs_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle in cachefs/: " + " -> ".join(cycle)
