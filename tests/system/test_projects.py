"""One job per project: two project folders deploying on this machine each get the tmux socket
of their own root, so neither stops nor shows the other's job; a folder that never deployed
says so."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_ops.remote.job import socket_for
from tests.cli_helpers import dflash, kill_tmux_server

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
