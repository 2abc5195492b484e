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

from dflash_ops import deploy_script, job

ROOT = Path(__file__).resolve().parent.parent
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
    assert deploy_script.SCRIPT in texts  # the deploy's one remote command, as assembled
    assert job.WRAPPER in texts  # what tmux runs for the job
    assert job.FUNCTIONS + 'dflash_job_stop "$@"\n' in texts


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
