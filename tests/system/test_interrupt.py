"""Ctrl-C at every step of `dflash deploy` and `dflash restart` leaves exactly one job, the old
one or the new one, and says which.

Each step is held deterministically by a slow tool: the place's `tmux`, `tar`, `mv`, `ln`,
`sort`, `readlink`, `grep` and the job's python are wrappers (first on the PATH of this machine,
the place) that wait at a gate while their arguments match the step's pattern; the stop is held
by the running job itself, which takes seconds to end after SIGINT. With the step held, the
command's process group gets SIGINT (as a terminal's Ctrl-C), the gate opens once the command
said it was interrupted, and the command must finish: before the old job is stopped nothing
changed (the old job runs, `current` is the old release); once it is stopped, the new release
runs. Over SSH and in a container of the `pct` stand-in, the same for one step on each side."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.cli_helpers import REPO, default_sigint, kill_tmux_server, wait_for

TOOLS = ("tmux", "tar", "mv", "ln", "sort", "readlink", "grep", "cat")
# The old job takes 3 s to end after SIGINT: the stop step is held by it.
JOB = (
    "trap 'echo got-int; sleep 3; exit 0' INT; "
    'echo "run of $DFLASH_RELEASE"; while :; do sleep 0.1; done'
)
NOTICE = "Interrupted: "

GATE = """#!/bin/bash
gates={gates}
if [ -f "$gates/slow" ] && [ "$(<"$gates/slow")" = {name} ]; then sleep 3; fi
if [ -f "$gates/gate" ]; then
  pattern=$(<"$gates/gate")
  case "{name} $*" in
    *"$pattern"*)
      echo "$$" > "$gates/reached"
      while [ -f "$gates/gate" ]; do sleep 0.02; done ;;
  esac
fi
exec {real} "$@"
"""


def gate_tools(gates: Path, tools: dict[str, str]) -> None:
    """Wrappers named `name` in `gates` running `real` unless held at the gate."""
    gates.mkdir(parents=True, exist_ok=True)
    for name, real in tools.items():
        path = gates / name
        path.write_text(GATE.format(gates=gates, name=name, real=real))
        path.chmod(0o755)


@dataclass
class Spot:
    """A project whose place runs through the gated tools; `root`/`checkpoints` as this
    machine sees them."""

    project: Path
    gates: Path
    root: Path
    checkpoints: Path
    socket: str
    env: dict[str, str]
    status_env: dict[str, str] = field(default_factory=dict)

    def dflash(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "dflash_ops", *args],
            cwd=self.project, env=self.env, capture_output=True, text=True, timeout=timeout,
        )  # fmt: skip

    def status(self) -> dict:  # type: ignore[type-arg]
        result = self.dflash("status", "--json")
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def current(self) -> str:
        return os.readlink(self.root / "current").removeprefix("releases/")

    def releases(self) -> list[str]:
        folder = self.root / "releases"
        return sorted(p.name for p in folder.iterdir() if (p / ".complete").exists())


def write_project(project: Path, *, target: str, socket: str) -> None:
    shutil.copytree(
        REPO / "trainer", project / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    (project / "deploy.toml").write_text(
        f"{target}\n[job]\nsocket = {json.dumps(socket)}\ncommand = {json.dumps(JOB)}\n"
        'stop_timeout = 10\nready = "run of"\n\n[train]\ndemo = true\n'
    )


def base_env(path_first: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("DFLASH_CONFIG", None)
    if path_first is not None:
        env["PATH"] = f"{path_first}:{env['PATH']}"
    return env


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Spot]:
    gates = tmp_path / "gates"
    tools = {name: shutil.which(name) or name for name in TOOLS}
    gate_tools(gates, {**tools, "python": sys.executable})
    project = tmp_path / "project"
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    write_project(
        project, target=f"[target]\npython = {json.dumps(str(gates / 'python'))}\n", socket=socket
    )
    root = project / ".dflash" / "local"
    yield Spot(project, gates, root, root / "checkpoints", socket, base_env(gates))
    kill_tmux_server(socket)


def interrupted(spot: Spot, args: list[str], *, pattern: str | None) -> tuple[int, str]:
    """Run `dflash ARGS`, hold it at the step matching `pattern` (None: the stop, held by the
    job), Ctrl-C it there, open the gate once it said so; its exit code and stderr."""
    gate, reached = spot.gates / "gate", spot.gates / "reached"
    reached.unlink(missing_ok=True)
    if pattern is not None:
        gate.write_text(pattern)
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_ops", *args], cwd=spot.project, env=spot.env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        preexec_fn=default_sigint,
    )  # fmt: skip
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr or []), daemon=True)
    reader.start()
    try:
        if pattern is not None:
            end = time.monotonic() + 90
            while not reached.exists():
                assert proc.poll() is None, "".join(err)
                assert time.monotonic() < end, f"never reached {pattern!r}: {''.join(err)}"
                time.sleep(0.01)
        else:
            wait_for(spot.checkpoints / "train_stdout.log", "got-int", timeout=90)
        os.killpg(proc.pid, signal.SIGINT)
        end = time.monotonic() + 30
        while not any(NOTICE in line for line in err) and proc.poll() is None:
            assert time.monotonic() < end, "".join(err)
            time.sleep(0.01)
        gate.unlink(missing_ok=True)
        code = proc.wait(timeout=90)
    finally:
        gate.unlink(missing_ok=True)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    return code, "".join(err)


def assert_one_job(spot: Spot, *, release: str, started_at: str | None = None) -> None:
    """Exactly one job session, running, started from `release`, which `current` names."""
    sessions = subprocess.run(
        ["tmux", "-L", spot.socket, "list-sessions", "-F", "#{session_name}"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert sessions.stdout.split() == ["dflash"], sessions
    report = spot.status()
    assert report["running"] and report["job_release"] == release == spot.current(), report
    if started_at is not None:
        assert report["started_at"] == started_at
    assert not (spot.root / "deploy.lock").is_symlink()


def old_job(spot: Spot) -> tuple[str, str]:
    """A running job (a first deploy): its release and start time."""
    first = spot.dflash("deploy")
    assert first.returncode == 0, first.stderr
    wait_for(spot.checkpoints / "train_stdout.log", "run of")
    report = spot.status()
    return report["job_release"], report["started_at"]


def check_outcome(
    spot: Spot, code: int, err: str, *, doing: str, old: tuple[str, str], new: bool
) -> None:
    assert "Traceback" not in err, err
    if not new:
        assert code == 130, err
        assert f"Interrupted before the running job was stopped: the {doing} changed nothing" in err
        assert_one_job(spot, release=old[0], started_at=old[1])
        return
    assert code == 0, err
    release = spot.current() if doing == "deploy" else old[0]
    assert f"the {doing} went on: release {release} is running" in err, err
    assert_one_job(spot, release=release)
    if doing == "deploy":
        assert release != old[0] and release == spot.releases()[-1]


# (step, the pattern that holds it; None: the stop, held by the job), in the order of the steps
DEPLOY = [
    ("tmux", "tmux -V", False),
    ("python", "python -c import json", False),
    ("lock", "ln -sT -- {", False),
    ("unpack", "tar -x", False),
    ("check", "python -m trainer check", False),
    ("stop", None, True),
    ("switch", "mv -T -- releases/", True),
    ("prune", "sort -u", True),
    ("archive", "/archive/", True),  # its mv; not the bundle's (the watcher's)
    ("start", "new-session", True),
    ("ready", "grep -qF -- run of", True),
]


RESTART = [
    ("lock", "ln -sT -- {", False),
    ("current", "readlink -- ", False),
    ("stop", None, True),
    ("archive", "/archive/", True),  # its mv; not the bundle's (the watcher's)
    ("start", "new-session", True),
    ("ready", "grep -qF -- run of", True),
]


ARGS = {"deploy": ["deploy"], "restart": ["restart", "--clean"]}
CASES = [("deploy", *case) for case in DEPLOY] + [("restart", *case) for case in RESTART]


@pytest.mark.parametrize(
    ("doing", "step", "pattern", "new"), CASES, ids=[f"{d}-{s}" for d, s, _, _ in CASES]
)
def test_ctrl_c_at_each_step(
    local: Spot, doing: str, step: str, pattern: str | None, new: bool
) -> None:
    old = old_job(local)
    code, err = interrupted(local, ARGS[doing], pattern=pattern)
    check_outcome(local, code, err, doing=doing, old=old, new=new)


@pytest.fixture
def ssh(tmp_path: Path, ssh_home: object) -> Iterator[Spot]:
    """The loopback SSH host: the job's python is the gated wrapper; the stop is held by the job."""
    gates = tmp_path / "gates"
    gate_tools(gates, {"python": sys.executable})
    project, socket = tmp_path / "project", f"dft-{uuid.uuid4().hex[:10]}"
    root, ckpt = tmp_path / "remote-root", tmp_path / "remote-ckpt"
    target = (
        f'[target]\nplace = "ssh"\nhost = "testbox"\nroot = "{root}"\ncheckpoints = "{ckpt}"\n'
        f"python = {json.dumps(str(gates / 'python'))}\n"
    )
    write_project(project, target=target, socket=socket)
    yield Spot(project, gates, root, ckpt, socket, base_env())
    kill_tmux_server(socket)


@pytest.mark.parametrize(("step", "pattern", "new"), [DEPLOY[4], DEPLOY[5]], ids=["check", "stop"])
def test_ctrl_c_over_ssh(ssh: Spot, step: str, pattern: str | None, new: bool) -> None:
    old = old_job(ssh)
    code, err = interrupted(ssh, ["deploy"], pattern=pattern)
    check_outcome(ssh, code, err, doing="deploy", old=old, new=new)


def test_ctrl_c_right_before_the_stop_still_changes_nothing(local: Spot) -> None:
    """No check step after the unpack ([train] empty beside a [job] command) and a slow `cat`:
    the caller's watcher (`cat` until stdin ends) is late, so the stop itself must find that
    the caller let go, and change nothing."""
    toml = local.project / "deploy.toml"
    toml.write_text(toml.read_text().replace("\n[train]\ndemo = true\n", "\n"))
    shutil.rmtree(local.project / "trainer")  # a bundle that fits a pipe: sent whole at once
    (local.project / "trainer").mkdir()
    old = old_job(local)
    (local.gates / "slow").write_text("cat")
    code, err = interrupted(local, ["deploy"], pattern="tar -x")
    check_outcome(local, code, err, doing="deploy", old=old, new=False)
