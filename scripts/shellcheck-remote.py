#!/usr/bin/env python3
"""Run shellcheck on every bash program dflash sends to a place, and on the repository's scripts.

The site program that changes a place is a file, `dflash_ops/remote/site.sh`, checked as one.
The small read-only programs live in Python strings. They are found where production uses them:
every list or tuple literal in `dflash_ops/` holding `"bash", "-c", SCRIPT` has its SCRIPT
expression evaluated in its own module, so the text checked is the text sent (the client's
`SITE`, read from site.sh, is checked as sent too). An expression that cannot be
evaluated that way is reported as an error rather than skipped.

    scripts/shellcheck-remote.py            exit 0: clean; 1: findings (printed); 2: no shellcheck
"""

from __future__ import annotations

import ast
import importlib
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "dflash_ops"
SHELL_FILES = ("scripts/*.sh", ".ci/run", "dflash_ops/**/*.sh")  # site.sh: the site program


@dataclass(frozen=True)
class Program:
    """One `bash -c` program: where it is used (module:line) and its text."""

    where: str
    text: str


def _bash_c_scripts(tree: ast.AST) -> list[ast.expr]:
    """The SCRIPT expressions of every `"bash", "-c", SCRIPT` run of elements in a literal."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.List | ast.Tuple):
            continue
        elts = node.elts
        for i in range(len(elts) - 2):
            a, b = elts[i], elts[i + 1]
            if (
                isinstance(a, ast.Constant)
                and a.value == "bash"
                and isinstance(b, ast.Constant)
                and b.value == "-c"
            ):
                found.append(elts[i + 2])
    return found


def programs(package: str = PACKAGE) -> list[Program]:
    """Every bash program the package's modules send, evaluated from the modules themselves."""
    sys.path.insert(0, str(ROOT))
    out = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        scripts = _bash_c_scripts(tree)
        if not scripts:
            continue
        rel = path.relative_to(ROOT).with_suffix("")
        module = importlib.import_module(".".join(rel.parts))
        for expr in scripts:
            where = f"{path.relative_to(ROOT)}:{expr.lineno}"
            code = compile(ast.Expression(expr), str(path), "eval")
            try:
                text = eval(code, vars(module))  # module constants only: the text that is sent
            except NameError as exc:
                raise SystemExit(
                    f"{where}: the script is built from local values ({exc})"
                ) from None
            if not isinstance(text, str):
                raise SystemExit(f"{where}: the script is not a string")
            out.append(Program(where, text))
    return out


def shell_files() -> list[Path]:
    return sorted(p for pattern in SHELL_FILES for p in ROOT.glob(pattern))


def check(programs: list[Program], files: list[Path]) -> tuple[int, str]:
    """shellcheck's exit status and report over the programs (as bash) and the files."""
    with tempfile.TemporaryDirectory(prefix="dflash-shellcheck-") as tmp:
        names = []
        for program in programs:
            name = Path(tmp) / (program.where.replace("/", ".").replace(":", "@") + ".bash")
            name.write_text(program.text)
            names.append(str(name))
        argv = ["shellcheck", "--norc", "-x", "-s", "bash", *names]
        first = subprocess.run(argv, capture_output=True, text=True)
        second = subprocess.run(
            ["shellcheck", "--norc", "-x", *map(str, files)], capture_output=True, text=True
        )
        report = (first.stdout + first.stderr).replace(tmp + "/", "")
        report += second.stdout + second.stderr
        return max(first.returncode, second.returncode), report


def main() -> int:
    if shutil.which("shellcheck") is None:
        print("shellcheck is not installed (scripts/install-system-deps.sh installs it)")
        return 2
    found = programs()
    status, report = check(found, shell_files())
    if report:
        print(report, end="")
    print(f"shellcheck: {len(found)} remote programs, {len(shell_files())} scripts", end="")
    print(": clean" if status == 0 else ": findings above")
    return 1 if status else 0


if __name__ == "__main__":
    sys.exit(main())
