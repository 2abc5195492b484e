"""`make run` as the README has a new user run it: its recipe (the repository's Makefile, with
this checkout's `.venv/bin`) deploys a job here and follows its log on a real terminal; the
documented Ctrl-C detaches, the job keeps running, and make reports no error. The output names
the `dflash` that is not on PATH by its path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.cli_helpers import REPO, dflash, kill_tmux_server
from tests.pty_helpers import Terminal

BIN = Path(sys.executable).parent  # the venv running the tests: its `dflash` script


@pytest.mark.serial  # in an xdist worker make run has hung after the Ctrl-C (not diagnosed)
@pytest.mark.skipif(not (BIN / "dflash").is_file(), reason="no dflash script beside python")
def test_ctrl_c_after_make_run_detaches_without_an_error(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    for name in ("Makefile", "scripts", "pyproject.toml"):
        (project / name).symlink_to(REPO / name)
    stamp = tmp_path / "installed"  # the venv is set up already
    stamp.touch()
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    (project / "deploy.toml").write_text(
        f'[job]\nsocket = "{socket}"\ncommand = "echo up; exec sleep 600"\n[train]\ndemo = true\n'
    )
    path = ":".join(p for p in os.environ["PATH"].split(":") if Path(p) != BIN)
    term = Terminal(
        ["make", "run", f"BIN={BIN}", f"STAMP={stamp}"],
        cwd=project,
        env={"PATH": path, "PYTHONPATH": str(REPO)},
    )
    try:
        term.read_until(r"\nup\r?\n", timeout=120)
        time.sleep(0.5)  # following: the next line would come from the job
        term.type("\x03")
        try:
            term.wait(timeout=60)
        except subprocess.TimeoutExpired:  # say what was left running, and what it printed
            tree = subprocess.run(["ps", "-o", "pid,pgid,stat,args", "-g", str(term.process.pid)],
                                  capture_output=True, text=True).stdout  # fmt: skip
            pytest.fail(f"make run still running 60 s after Ctrl-C:\n{tree}\n{term.text[-3000:]}")
    finally:
        term.close()
        report = dflash(project, "status", "--json")
        kill_tmux_server(socket)
    text = term.text
    assert "Detached from the log; the job keeps running." in text, text
    assert "Error 130" not in text and "Interrupt" not in text and "Traceback" not in text
    assert f"Follow it with: {BIN / 'dflash'} logs --follow" in text
    assert f"dflash is not on your PATH: `source {BIN / 'activate'}`" in text
    assert json.loads(report.stdout)["running"]


@pytest.mark.skipif(not (BIN / "dflash").is_file(), reason="no dflash script beside python")
def test_the_next_command_is_named_as_it_can_be_typed(tmp_path: Path) -> None:
    others = [p for p in os.environ["PATH"].split(":") if Path(p) != BIN]
    for path, named in (
        (others, f"{BIN / 'dflash'} doctor"),
        ([str(BIN), *others], "dflash doctor"),
    ):
        env = {**os.environ, "PATH": ":".join(path), "PYTHONPATH": str(REPO)}
        result = subprocess.run(
            [str(BIN / "dflash"), "init", "--force"], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert f"Next: {named}, then" in result.stderr
