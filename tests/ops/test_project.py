"""A project folder's own folders at remote places (`.dflash/project.json`): drawn once per
folder, the same for every later command (also when two commands draw at once and when the folder
moves), another for a fresh clone; a folder an earlier dflash deployed from keeps the root every
project shared then."""

from __future__ import annotations

import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dflash_ops.errors import ConfigError
from dflash_ops.remote.job import socket_for
from dflash_ops.settings import project
from tests.cli_helpers import REPO, dflash, kill_tmux_server


def test_each_folder_gets_its_own_root_and_keeps_it(tmp_path: Path) -> None:
    one, two = tmp_path / "my proj", tmp_path / "clone"
    one.mkdir(), two.mkdir()
    first = project.load(one)
    assert first.id.startswith("my-proj-") and len(first.id) == len("my-proj-") + 8
    assert (first.remote_root, first.remote_checkpoints) == (
        f"/root/dflash/{first.id}", f"/workspace/dflash/{first.id}",
    )  # fmt: skip
    assert project.load(one) == first and not first.legacy
    other = project.load(two)
    assert other.id != first.id and socket_for(other.remote_root) != socket_for(first.remote_root)
    moved = tmp_path / "moved"
    shutil.move(one, moved)
    assert project.load(moved) == first


def test_a_folder_deployed_by_an_earlier_dflash_keeps_the_shared_root(tmp_path: Path) -> None:
    (tmp_path / ".dflash").mkdir()
    (tmp_path / ".dflash" / "state.json").write_text("{}")
    old = project.load(tmp_path)
    assert (old.remote_root, old.remote_checkpoints) == ("/root/dflash", "/workspace/checkpoints")
    assert old.legacy and project.load(tmp_path) == old


def test_commands_drawing_at_once_agree(tmp_path: Path) -> None:
    script = (
        "import sys, pathlib; from dflash_ops.settings import project; "
        "print(project.load(pathlib.Path(sys.argv[1])).id)"
    )
    runs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            stdout=subprocess.PIPE,
            text=True,
            env={"PYTHONPATH": str(REPO)},
        )  # fmt: skip
        for _ in range(6)
    ]
    ids = {run.communicate(timeout=60)[0].strip() for run in runs}
    assert ids == {project.load(tmp_path).id}
    assert [p.name for p in (tmp_path / ".dflash").iterdir()] == ["project.json"]


@pytest.mark.parametrize("text", ["{", '{"id": "x"}', '{"id": "x", "remote_root": "rel", '
                                  '"remote_checkpoints": "/c"}'])  # fmt: skip
def test_a_damaged_file_is_named(tmp_path: Path, text: str) -> None:
    (tmp_path / ".dflash").mkdir()
    (tmp_path / ".dflash" / "project.json").write_text(text)
    with pytest.raises(ConfigError, match="project.json is unreadable") as info:
        project.load(tmp_path)
    assert "set root and checkpoints" in info.value.hint


def test_a_folder_that_deploys_here_first_is_no_earlier_dflash(tmp_path: Path) -> None:
    """Deploying to this machine writes state.json; the project is drawn before that, so a
    later remote deploy gets the folder's own root, not the shared one of an earlier dflash."""
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    (tmp_path / "deploy.toml").write_text(f'[job]\nsocket = "{socket}"\ncommand = "true"\n')
    try:
        assert dflash(tmp_path, "deploy").returncode == 0
    finally:
        kill_tmux_server(socket)
    assert (tmp_path / ".dflash" / "state.json").is_file()
    assert not project.load(tmp_path).legacy
