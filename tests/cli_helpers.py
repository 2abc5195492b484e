"""Helpers for the CLI tests: run `python -m dflash_ops` in a project folder, write configs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_ops.settings import project as projects

REPO = Path(__file__).resolve().parent.parent


def default_sigint() -> None:
    """`preexec_fn` of a CLI run that a test interrupts: a suite started in the background by a
    non-interactive shell inherits SIGINT ignored, and so would the CLI (Python then installs no
    KeyboardInterrupt); give it the default, as a terminal's Ctrl-C finds it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@dataclass
class Where:
    """A place the CLI tests deploy to, and where its files can be inspected from this machine."""

    kind: str  # "local" | "ssh" | "proxmox"
    project: Path
    flags: list[str]  # target selection flags for deploy
    root: Path  # host path of the target's root (releases/, current)
    checkpoints: Path  # host path of the target's checkpoints folder
    socket: str
    targets: str = ""  # extra deploy.toml text ([targets.NAME] tables)
    canary_at: str = ""  # a path as the job sees it, that must never be created
    canary_host: Path = Path("/nonexistent")  # the same file as this machine sees it
    cleanups: list[Callable[[], None]] = field(default_factory=list)

    def config(
        self,
        command: str,
        *,
        env: dict[str, str] | None = None,
        extra: str = "",
        stop_timeout: float = 3,
    ) -> None:
        env_line = ", ".join(f"{k} = {json.dumps(v)}" for k, v in (env or {}).items())
        text = (
            f"{self.targets}\n[job]\nsocket = {json.dumps(self.socket)}\n"
            f"command = {json.dumps(command)}\nstop_timeout = {stop_timeout}\n"
            + (f"env = {{ {env_line} }}\n" if env_line else "")
            + extra
            + "\n[train]\ndemo = true\n"
        )
        (self.project / "deploy.toml").write_text(text)

    def run(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        return dflash(self.project, *args, timeout=timeout)

    def status(self, *flags: str) -> dict[str, Any]:
        result = self.run("status", "--json", *flags)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    def wait_exited(self, timeout: float = 30) -> dict[str, Any]:
        end = time.monotonic() + timeout
        while True:
            report = self.status()
            if not report["running"] or time.monotonic() > end:
                return report
            time.sleep(0.3)

    def releases(self) -> list[str]:
        folder = self.root / "releases"
        return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def train_argv(config: Path, out: Path, *extra: str) -> list[str]:
    """`python -m trainer train --config CONFIG --out OUT EXTRA…`: a run as `launch.sh` starts
    one, with this interpreter."""
    return [sys.executable, "-m", "trainer", "train", "--config", str(config), "--out", str(out),
            *extra]  # fmt: skip


def dflash(project: Path, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    # the repo first; what the caller's PYTHONPATH holds (packages installed there) stays
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.pop("DFLASH_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "dflash_ops", *args],
        cwd=project,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def container_defaults(proxmox: Any, ct: int, project: Path) -> tuple[Path, Path]:
    """Host paths of `project`'s default root and checkpoints inside container `ct` of the
    stand-in (its /root and /workspace are `root_dir(ct)` and `workspace_dir(ct)`)."""
    own = projects.load(project)
    return (
        proxmox.root_dir(ct) / Path(own.remote_root).relative_to("/root"),
        proxmox.workspace_dir(ct) / Path(own.remote_checkpoints).relative_to("/workspace"),
    )


def wait_for(path: Path, text: str, timeout: float = 20) -> str:
    """The text of `path` once `text` is in it (a job's log, as the test's machine sees it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.1)
    raise AssertionError(f"{text!r} not in {path} in time")


def kill_tmux_server(socket: str) -> None:
    subprocess.run(["tmux", "-L", socket, "kill-server"], capture_output=True)


def any_where(
    request: Any, tmp_path: Path, ct: int, *, python: str | None = None
) -> Iterator[Where]:
    """`remote_where`, and "local" too: this machine, the project's default root."""
    if request.param != "local":
        yield from remote_where(request, tmp_path, ct, python=python)
        return
    project = tmp_path / "project"
    project.mkdir()
    root = project / ".dflash" / "local"
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    try:
        yield Where("local", project, [], root, root / "checkpoints", socket)
    finally:
        kill_tmux_server(socket)


def remote_where(
    request: Any, tmp_path: Path, ct: int, *, python: str | None = None
) -> Iterator[Where]:
    """A project folder and the remote place of `request.param`: "ssh" (the sshd fixture's
    `testbox`, a `[targets.box]` entry) or "proxmox" (container `ct` of the `pct` stand-in,
    created here). The body of the modules' parametrised `remote` fixtures. `python`: the
    job's interpreter (this one, lent to the container: `[targets.pve]` then names the place)."""
    project = tmp_path / "project"
    project.mkdir()
    sock = f"dft-{uuid.uuid4().hex[:10]}"
    interpreter = f"python = {json.dumps(python)}\n" if python else ""
    if request.param == "ssh":
        request.getfixturevalue("ssh_home")
        root, ckpt = tmp_path / "root", tmp_path / "ckpt"
        where = Where("ssh", project, ["--target", "box"], root, ckpt, sock)
        where.targets = (
            f'[targets.box]\nplace = "ssh"\nhost = "testbox"\n{interpreter}'
            f'root = "{root}"\ncheckpoints = "{ckpt}"\n'
        )
    else:
        proxmox = request.getfixturevalue("proxmox")
        proxmox.create(ct)
        root, checkpoints = container_defaults(proxmox, ct, project)
        flags = ["--host", proxmox.alias, "--ct", str(ct)]
        where = Where("proxmox", project, flags, root, checkpoints, sock)
        if python:
            from tests.ops.test_doctor import lend_python  # under /root: the container's own

            lend_python(proxmox, ct)
            where.flags = ["--target", "pve"]
            where.targets = (
                f'[targets.pve]\nplace = "proxmox"\nhost = "{proxmox.alias}"\nct = {ct}\n'
                + interpreter
            )
    yield where
    if request.param == "ssh":
        kill_tmux_server(sock)
