"""The bash dflash sends to a place, and the repository's shell scripts, are shellcheck-clean.

`scripts/shellcheck-remote.py` finds each `bash -c` program where production builds it; these
tests run it (CI installs shellcheck through scripts/install-system-deps.sh)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_ops.remote import client, job

ROOT = Path(__file__).resolve().parents[2]
CHECKER = ROOT / "scripts" / "shellcheck-remote.py"
needs_shellcheck = pytest.mark.skipif(
    shutil.which("shellcheck") is None, reason="shellcheck is not installed"
)


def _checker():
    spec = importlib.util.spec_from_file_location("shellcheck_remote", CHECKER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_the_programs_checked_are_the_ones_sent() -> None:
    texts = {p.text for p in _checker().programs()}
    assert client.SITE in texts  # the site program, as the client sends it
    assert job.WRAPPER in texts  # what tmux runs for the job
    assert ROOT / "dflash_ops" / "remote" / "site.sh" in _checker().shell_files()


@needs_shellcheck
def test_a_finding_fails_the_check() -> None:
    checker = _checker()
    status, report = checker.check([checker.Program("x.py:1", "rm -rf $dir/*\n")], [])
    assert status != 0
    assert "SC2086" in report and "x.py@1" in report


@needs_shellcheck
def test_remote_programs_and_scripts_are_clean() -> None:
    run = subprocess.run(
        [sys.executable, str(CHECKER)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stdout + run.stderr
