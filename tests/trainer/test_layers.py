"""The trainer's modules form layers: no import cycle (imports inside functions included, so a
deferred import cannot hide one) and no module over ~500 lines."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "trainer"
MAX_LINES = 500


def imports_of(path: Path) -> set[str]:
    """The `trainer.*` modules `path` imports, wherever in the file the import is."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("trainer."))
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "trainer":  # `from trainer import checkpoint`
                found.update(f"trainer.{a.name}" for a in node.names)
            elif node.module.startswith("trainer."):
                found.add(node.module)
    return found


def graph() -> dict[str, set[str]]:
    modules = {f"trainer.{p.stem}": p for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    return {name: imports_of(path) & modules.keys() for name, path in modules.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path that ends where it began, or None (depth-first)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_trainer_package_has_no_import_cycle() -> None:
    edges = graph()
    assert "trainer.runtime" in edges["trainer.evaluate"]  # the graph sees deferred imports
    cycle = find_cycle(edges)
    assert cycle is None, " → ".join(cycle or [])


def test_no_trainer_module_is_over_500_lines() -> None:
    long = {
        p.name: n
        for p in PACKAGE.glob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by job: {long}"
