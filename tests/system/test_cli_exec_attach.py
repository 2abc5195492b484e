"""`dflash exec -- CMD…` and `dflash attach` on all three places, as a user runs them: exec runs
the command in the job's folder and environment (its python first on PATH), passes every word
literally and exits with the command's code; attach puts this terminal (a real pty) on the job's
tmux pane — here by tmux itself, elsewhere through the real `ssh` client with the argv dflash
builds (the loopback sshd; `pct exec` on the Proxmox stand-in) — and Ctrl-b d detaches while the
job keeps running."""

from __future__ import annotations

import shlex
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_helpers import REPO, Where, any_where
from tests.pty_helpers import Terminal

CT = 236
JOB = "echo up; exec sleep 600"


@pytest.fixture(params=["local", "ssh", "proxmox"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Where]:
    places = any_where(request, tmp_path, CT, python=sys.executable)
    spot = next(places)
    spot.config(JOB, env={"GREETING": "hi there"})
    yield spot
    next(places, None)  # the place's teardown


def test_exec_runs_in_the_jobs_folder_and_environment(where: Where) -> None:
    before = where.run("exec", *where.flags, "--", "true")
    assert before.returncode == 1 and "Nothing is deployed" in before.stderr
    assert where.run("deploy", *where.flags).returncode == 0
    script = (
        'echo "$PWD|$DFLASH_CHECKPOINTS|$GREETING|${CUDA_VISIBLE_DEVICES-unset}|"; '
        "command -v python; echo oops >&2; exit 7"
    )
    result = where.run("exec", "--", "sh", "-c", script)  # sh: no ~/.bashrc of the account
    assert result.returncode == 7, result.stderr
    (release,) = where.releases()
    lines = result.stdout.splitlines()
    at_place = str(where.checkpoints) if where.kind != "proxmox" else lines[0].split("|")[1]
    assert lines[0].split("|")[0].endswith(f"/releases/{release}")
    assert lines[0].split("|")[1:] == [at_place, "hi there", "", ""]  # gpus = 0: no GPU
    assert lines[1] == str(Path(sys.executable).parent / "python")
    assert result.stderr == "oops\n"

    words = ["a b", "$HOME", "it's", "x;", "-n", "*"]
    echoed = where.run("exec", "--", "printf", "[%s]", *words)
    assert echoed.returncode == 0 and echoed.stdout == "".join(f"[{w}]" for w in words)
    missing = where.run("exec", "--", "no-such-command-here")
    assert missing.returncode == 127


def test_attach_and_detach_on_a_real_terminal(where: Where) -> None:
    assert where.run("deploy", *where.flags).returncode == 0
    started = where.status()["started_at"]
    argv = [sys.executable, "-m", "dflash_ops", "attach"]
    term = Terminal(argv, cwd=where.project, env={"PYTHONPATH": str(REPO)})
    try:
        term.read_until(r"detach with Ctrl-b d", timeout=60)
        term.read_until(r"\[dflash\]", timeout=60)  # tmux's status line: attached
        time.sleep(1)  # tmux reads keys once it has drawn the whole screen
        term.type("\x02")  # Ctrl-b, then d
        time.sleep(0.3)
        term.type("d")
        term.read_until(r"\[detached", timeout=30)
        code = term.wait(timeout=30)
    finally:
        term.close()
    assert code == 0, term.text
    report = where.status()
    assert report["running"] and report["started_at"] == started


def test_attach_needs_a_terminal_and_a_job(where: Where) -> None:
    if where.kind != "local":
        pytest.skip("said here, whatever the place")
    piped = where.run("attach")
    assert piped.returncode == 1 and "needs a terminal" in piped.stderr
    term = Terminal(
        [sys.executable, "-m", "dflash_ops", "attach"], cwd=where.project,
        env={"PYTHONPATH": str(REPO)},
    )  # fmt: skip
    try:
        term.read_until("No job deployed from here", timeout=60)
        assert term.wait(timeout=30) == 1
    finally:
        term.close()


def test_the_ssh_argv_is_what_ssh_takes(where: Where) -> None:
    """The remote argv, word for word: ssh's own parser (`ssh -G`) reads the same destination
    from it as dflash resolved (host name, port, user)."""
    if where.kind == "local":
        pytest.skip("no ssh here")
    import subprocess

    from dflash_ops.commands import attach as attaching
    from dflash_ops.commands.workspace import Workspace
    from dflash_ops.settings.deploy_config import TargetFlags

    assert where.run("deploy", *where.flags).returncode == 0
    ws = Workspace.load(config_file=where.project / "deploy.toml", flags=TargetFlags())
    try:
        argv = attaching.attach_argv(ws, term="xterm")
        target = ws.place.transport.target  # type: ignore[attr-defined]
    finally:
        ws.close()
    assert argv[:2] == ["ssh", "-t"] and argv[-2] == f"{target.user}@{target.alias}"
    resolved = subprocess.run(["ssh", "-G", *argv[1:-1]], capture_output=True, text=True)
    assert resolved.returncode == 0, resolved.stderr
    said = dict(line.split(" ", 1) for line in resolved.stdout.splitlines() if " " in line)
    assert (said["hostname"], said["port"], said["user"]) == (
        target.hostname, str(target.port), target.user,
    )  # fmt: skip
    remote = shlex.split(argv[-1])
    tmux = ["tmux", "-L", where.socket, "attach-session", "-t", "=dflash"]
    if where.kind == "proxmox":
        assert remote == [
            "pct",
            "exec",
            str(CT),
            "--keep-env",
            "0",
            "--",
            "env",
            "TERM=xterm",
            *tmux,
        ]
    else:
        assert remote == tmux
