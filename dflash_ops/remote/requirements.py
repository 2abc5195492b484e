"""What the bundle's trainer needs from the job's python: the modules its sources import.

The list is read from the sources themselves (an `ast` walk of `trainer/`), never kept by hand:
a new import is checked at the place by the next `dflash doctor` and deploy, which run ONE
`python -c` there naming every module that does not import. Left out: the standard library, the
trainer's own package, and the modules the trainer probes for, which it can do without — a
plain `import M` of the top-level module inside a `try` whose handler catches `ImportError`
(triton, tensorboard). `trainer/requirements.txt` names the distributions that provide the rest
(what `dflash setup` installs into the job's venv); tests/ops/test_requirements.py keeps the two
equal.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

REQUIREMENTS = "requirements.txt"  # in trainer/
_CATCHES = {"ImportError", "ModuleNotFoundError", "Exception", "BaseException"}


def required_modules(trainer: Path) -> list[str]:
    """The top-level third-party modules the `.py` files under `trainer` import, without those
    it probes for; [] when there is no trainer there."""
    found: set[str] = set()
    probed: set[str] = set()
    for path in sorted(trainer.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name, probe in _imports(tree, guarded=False):
            (probed if probe else found).add(name)
    own = {trainer.name, "__future__"} | {p.stem for p in trainer.glob("*.py")}
    return sorted(m for m in found - probed if m not in own and not _stdlib(m))


def _stdlib(name: str) -> bool:
    return name in sys.stdlib_module_names


def _imports(node: ast.AST, *, guarded: bool) -> Iterator[tuple[str, bool]]:
    """(top-level module, whether this import is a probe for it) of every import in `node`:
    a probe is `import M` of a top-level module inside a try that copes without it."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name.split(".")[0], guarded and "." not in alias.name
    elif isinstance(node, ast.ImportFrom):
        if node.level == 0 and node.module:  # relative imports are the trainer's own
            yield node.module.split(".")[0], False
    elif isinstance(node, ast.Try | ast.TryStar):
        copes = guarded or any(_copes(handler) for handler in node.handlers)
        for statement in node.body:
            yield from _imports(statement, guarded=copes)
        for part in (*node.handlers, *node.orelse, *node.finalbody):
            yield from _imports(part, guarded=guarded)
    else:
        for child in ast.iter_child_nodes(node):
            yield from _imports(child, guarded=guarded)


def _copes(handler: ast.ExceptHandler) -> bool:
    """Whether `except …:` catches a failed import (a bare except does)."""
    if handler.type is None:
        return True
    types = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(t, ast.Name) and t.id in _CATCHES for t in types)
