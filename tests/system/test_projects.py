"""One job per project: two project folders deploying on this machine, or into one container
of a Proxmox node, each get their own root and the tmux socket keyed to it, so neither stops
nor shows the other's job; a folder that never deployed says so. A folder deployed by an
earlier dflash keeps the root every project shared then."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dflash_ops.remote.job import socket_for
from dflash_ops.settings import project as project_settings
from tests.cli_helpers import container_defaults, dflash, kill_tmux_server

JOB = '[job]\ncommand = "echo started; exec sleep 600"\nstop_timeout = 3\n[train]\ndemo = true\n'


@pytest.fixture
def projects(tmp_path: Path) -> Iterator[list[Path]]:
    folders = [tmp_path / name for name in ("one", "two", "three")]
    for folder in folders:
        folder.mkdir()
        (folder / "deploy.toml").write_text(JOB)
    yield folders
    for folder in folders:  # the default sockets of their local roots
        kill_tmux_server(socket_for(str(folder / ".dflash" / "local")))


def status(project: Path) -> dict:
    result = dflash(project, "status", "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_two_projects_on_one_machine_keep_their_own_jobs(projects: list[Path]) -> None:
    one, two, three = projects
    assert dflash(one, "deploy").returncode == 0
    first = status(one)
    assert first["running"] and first["socket"] == socket_for(str(one / ".dflash" / "local"))

    second = dflash(two, "deploy")
    assert second.returncode == 0, second.stderr
    assert "Stopped the previous job" not in second.stderr
    again = status(one)
    assert again["running"] and again["started_at"] == first["started_at"]
    assert status(two)["running"] and status(two)["socket"] != first["socket"]

    # A folder that never deployed sees no job, and says so.
    never = status(three)
    assert not never["exists"] and not never["deployed_here"]
    human = dflash(three, "status")
    assert "no job deployed from here" in human.stdout and "hint:" in human.stderr
    for args in (["logs"], ["logs", "--follow"], ["stop"]):
        result = dflash(three, *args, timeout=30)
        assert "No job deployed from here" in result.stderr, (args, result.stderr)
        assert "hint: Deploy from this folder" in result.stderr
        assert "started" not in result.stdout  # nobody else's log
    assert status(one)["running"] and status(two)["running"]

    stopped = dflash(two, "stop")
    assert stopped.returncode == 0 and not status(two)["running"]
    assert status(one)["running"]


CT = 233


def on(project: Path, *args: str, flags: list[str]) -> subprocess.CompletedProcess[str]:
    return dflash(project, *args, *flags, timeout=120)


def container_status(project: Path, flags: list[str]) -> dict:
    result = on(project, "status", "--json", flags=flags)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_two_projects_on_one_container_keep_their_own_jobs(
    projects: list[Path], proxmox: Any
) -> None:
    """The reported case: from a fresh clone that never deployed, `stop --host … --ct …`
    stopped the other folder's job, both having the default root /root/dflash."""
    proxmox.create(CT)
    flags = ["--host", proxmox.alias, "--ct", str(CT)]
    one, two, three = projects
    assert on(one, "deploy", flags=flags).returncode == 0
    first = container_status(one, flags)
    own = project_settings.load(one)
    assert first["running"] and first["socket"] == socket_for(own.remote_root)
    assert own.remote_root == f"/root/dflash/{own.id}" and own.id.startswith("one-")
    root, checkpoints = container_defaults(proxmox, CT, one)
    assert (root / "current").is_symlink() and (checkpoints / "train_stdout.log").is_file()

    second = on(two, "deploy", flags=flags)
    assert second.returncode == 0, second.stderr
    assert "Stopped the previous job" not in second.stderr
    assert container_status(one, flags)["started_at"] == first["started_at"]
    assert container_status(two, flags)["running"]

    for args in (["stop"], ["status"], ["logs"]):
        result = on(three, *args, flags=flags)
        assert "o job deployed from here" in result.stdout + result.stderr, (args, result.stderr)
        assert "hint: Deploy from this folder" in result.stderr
    assert container_status(one, flags)["running"] and container_status(two, flags)["running"]
    assert on(two, "stop", flags=flags).returncode == 0
    assert container_status(one, flags)["running"]
    assert not container_status(two, flags)["running"]


def test_a_folder_that_deployed_before_keeps_the_shared_root(
    projects: list[Path], proxmox: Any
) -> None:
    """A folder deployed by an earlier dflash (state.json, no project.json) finds its job in
    /root/dflash; deploy says how to move it; a fresh folder is told that job is there."""
    proxmox.create(CT)
    flags = ["--host", proxmox.alias, "--ct", str(CT)]
    old, fresh, _ = projects
    old_config = (old / "deploy.toml").read_text()
    (old / "deploy.toml").write_text(  # where an earlier dflash put it: the shared root
        f'[targets.pve]\nplace = "proxmox"\nhost = "{proxmox.alias}"\nct = {CT}\n'
        'root = "/root/dflash"\ncheckpoints = "/workspace/checkpoints"\n' + old_config
    )
    assert on(old, "deploy", flags=["--target", "pve"]).returncode == 0
    (old / "deploy.toml").write_text(old_config)
    (old / ".dflash" / "project.json").unlink(missing_ok=True)
    assert json.loads((old / ".dflash" / "state.json").read_text())["flags"] == {"target": "pve"}
    state = old / ".dflash" / "state.json"  # as an earlier dflash wrote it after --host --ct
    record = json.loads(state.read_text())
    state.write_text(json.dumps({**record, "flags": {"host": proxmox.alias, "ct": CT}}))

    found = container_status(old, [])  # the remembered target, the default root
    assert found["running"] and found["socket"] == socket_for("/root/dflash")
    assert project_settings.load(old).legacy

    fresh_stop = on(fresh, "stop", flags=flags)
    assert "No job deployed from here" in fresh_stop.stderr
    assert "A job deployed by an earlier dflash runs in /root/dflash" in fresh_stop.stderr
    assert container_status(old, [])["running"]

    again = on(old, "deploy", flags=[])
    assert again.returncode == 0, again.stderr
    own = project_settings.load(old)
    assert "the root every project shared" in again.stderr
    assert f'root = "/root/dflash/{own.id}"' in again.stderr
    assert container_status(old, [])["running"]
    assert on(old, "stop", flags=[]).returncode == 0
