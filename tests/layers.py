"""The import graph of a package, read with `ast` (imports inside functions included, so a
deferred import cannot hide a cycle), for the layer tests of both packages."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 500


def module_name(path: Path) -> str:
    """`trainer/data/shards.py` → `trainer.data.shards`; `dflash_ops/connect/__init__.py` →
    `dflash_ops.connect`."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(
    path: Path, prefixes: tuple[str, ...], known: frozenset[str] = frozenset()
) -> set[str]:
    """The modules under `prefixes` that `path` imports, wherever in the file the import is.
    `from pkg import mod` imports `pkg.mod` when that is one of the `known` modules (a package
    whose module imports a sibling is not importing itself); otherwise it counts as `pkg`."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            found |= (subs & known) or {node.module, *subs}
    return {name for name in found if name.split(".")[0] in prefixes}


def modules(package: str) -> dict[str, Path]:
    return {module_name(p): p for p in (ROOT / package).rglob("*.py")}


def graph(package: str) -> dict[str, set[str]]:
    """Module → the modules of the same package it imports (packages count as their
    `__init__`, which imports nothing here)."""
    mods = modules(package)
    return {
        name: (imports_of(path, (package,), frozenset(mods)) & mods.keys()) - {name}
        for name, path in mods.items()
    }


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


def long_modules(package: str, *, limit: int = MAX_LINES) -> dict[str, int]:
    """Modules over `limit` lines, with their length."""
    return {
        name: n
        for name, path in modules(package).items()
        if (n := len(path.read_text().splitlines())) > limit
    }
