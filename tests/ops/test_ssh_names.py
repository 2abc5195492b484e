"""Hostile host and user names never run anything: not ssh -G, not a `Match exec` line.

The private HOME's ssh_config has `Match exec "touch <dir>/CANARY_%h"`, and a stand-in `ssh`
first on PATH records every call before it runs the real client. Every name below tries to
create a file in the same folder. Through `resolve`, `--host`, `--user` and deploy.toml, the
CLI exits 1 with one `error:` line and a hint, and the folder stays empty.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from dflash_ops.connect.ssh_config import resolve
from dflash_ops.errors import InvalidHostName
from tests.cli_helpers import dflash


def payloads(canary: Path) -> list[str]:
    touch = f"touch${{IFS}}{canary}/pwned"
    return [
        f"$({touch})",
        f"`{touch}`",
        f"a;{touch}",
        f"a|{touch}",
        f"a&&{touch}",
        f"a\n{touch}",
        f"a>{canary}/pwned",
        f"-oProxyCommand={touch}",
        f"a'{touch}'",
        f'a"{touch}"',
        f"a {touch}",
        f"a\\;{touch}",
    ]


@pytest.fixture
def canary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty folder that anything run would write into; HOME's config and ssh point at it."""
    folder = tmp_path / "canary"
    folder.mkdir()
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        f'Match exec "touch {folder}/CANARY_%h"\n    User someone\n'
    )
    monkeypatch.setenv("HOME", str(home))
    return folder


def _path_with_recording_ssh(tmp_path: Path, canary: Path) -> str:
    """A folder whose `ssh` notes each run in the canary folder, then runs the real one."""
    bin_dir = tmp_path / "bin-ssh"
    bin_dir.mkdir()
    real = shutil.which("ssh")
    assert real is not None, "the ssh client is one of the tests' tools"
    (bin_dir / "ssh").write_text(
        f'#!/bin/sh\necho "$@" >> {canary}/ssh-was-run\nexec {real} "$@"\n'
    )
    (bin_dir / "ssh").chmod(0o755)
    return str(bin_dir)


def test_resolve_refuses_before_running_anything(
    canary: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", _path_with_recording_ssh(tmp_path, canary))
    for name in payloads(canary):
        for kwargs in ({"host": name}, {"host": "box", "user": name}, {"host": f"{name}@box"}):
            host = kwargs.pop("host")
            with pytest.raises(InvalidHostName) as info:
                resolve(host, **kwargs)
            assert "ssh refuses" in str(info.value) or "starts with '-'" in str(info.value)
    assert list(canary.iterdir()) == []


def test_a_valid_name_does_reach_match_exec(canary: Path, tmp_path: Path) -> None:
    """The canary line works: the same config, a plain name, and ssh_config runs it."""
    resolve("plainbox")
    assert (canary / "CANARY_plainbox").exists()


def _project(tmp_path: Path, target: str) -> Path:
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    (project / "deploy.toml").write_text(f'{target}[job]\ncommand = "true"\n[train]\ndemo = true\n')
    return project


def test_cli_refuses_hostile_names_with_one_error(
    canary: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _path_with_recording_ssh(tmp_path, canary)
    monkeypatch.setenv("PATH", os.pathsep.join([path, str(Path(sys.executable).parent)]))
    names = payloads(canary)[:4] + payloads(canary)[7:8]
    runs = 0
    for name in names:
        toml_host = name.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        cases = [
            (_project(tmp_path, ""), ["status", "--host", name]),
            (_project(tmp_path, ""), ["status", "--host", "box", "--user", name]),
            (_project(tmp_path, f'[target]\nplace = "ssh"\nhost = "{toml_host}"\n'), ["status"]),
        ]
        for project, args in cases:
            result = dflash(project, *args, timeout=60)
            runs += 1
            assert result.returncode == 1, result.stderr
            lines = result.stderr.splitlines()
            assert lines[0].startswith("error:")
            assert any(why in lines[0] for why in ("ssh refuses", "'-'", "not a host name"))
            assert lines[-1].startswith("hint:") and "Traceback" not in result.stderr
    assert runs == 15
    assert list(canary.iterdir()) == []
