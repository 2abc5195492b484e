"""Each benchmark's `--help` is its reference (bench/README.md says only what each measures):
it runs as the README shows it, `python bench/<script>.py --help`, and prints the script's
docstring and a line of help for every option."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.cli_helpers import REPO

SCRIPTS = sorted(
    p for p in (REPO / "bench").glob("*.py") if 'if __name__ == "__main__":' in p.read_text()
)


def options_without_help(path: Path) -> list[int]:
    """Lines of `add_argument` calls that give no `help=`."""
    calls = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)]
    return [
        c.lineno
        for c in calls
        if getattr(c.func, "attr", "") == "add_argument"
        and "help" not in {k.arg for k in c.keywords}
    ]


def test_help_is_the_docstring_and_every_option_says_what_it_does() -> None:
    """All at once (each pays the imports of torch and the trainer)."""
    running = {
        script: subprocess.Popen(
            [sys.executable, str(script), "--help"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for script in SCRIPTS
    }
    assert len(running) >= 15
    for script, proc in running.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (script.name, err[-2000:])
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
        first = " ".join(doc.split("\n\n")[0].split())
        assert first and first in " ".join(out.split()), script.name
        assert options_without_help(script) == [], script.name


def test_the_recipe_runner_explains_itself() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "bench.recipes", "run", "--help"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert shown.returncode == 0 and "--only" in shown.stdout and "--smoke" in shown.stdout
