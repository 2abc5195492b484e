"""Archiving (the site program's restart --clean) and listing the checkpoints folder on the
local place (real files, real mv)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_ops.connect.place import HostPlace
from dflash_ops.connect.transport import LocalTransport
from dflash_ops.errors import CheckpointPathError
from dflash_ops.remote.checkpoints import Checkpoints, Entry, is_run
from tests.site_helpers import make_site, start, tmux_socket_fixture  # noqa: F401


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-100").mkdir(parents=True)
    (ckpt / "step-100" / "model.pt").write_bytes(b"w" * 10)
    (ckpt / "metrics.jsonl").write_text('{"step": 100}\n')
    (ckpt / "train_stdout.log").write_text("log\n")
    (ckpt / ".hidden").write_text("h")
    (ckpt / "odd name\nwith newline; $(x)").write_text("o")
    return ckpt


def checkpoints(path: Path | str) -> Checkpoints:
    return Checkpoints(HostPlace(LocalTransport()), str(path))


def archive(folder: Path, tmp_path: Path, socket: str) -> str | None:
    """`restart --clean` through the site program: the job stops, the checkpoints folder is
    archived, the job (`true`, logging outside the folder) starts again."""
    site = make_site(
        HostPlace(LocalTransport()), tmp_path / "root", socket,
        checkpoints=folder, log=tmp_path / "job.log",
    )  # fmt: skip
    return start(site, ["true"], cwd=tmp_path, env={}, archive=True).archived


def test_archive_moves_everything_and_deletes_nothing(
    folder: Path, tmp_path: Path, tmux_socket: str
) -> None:
    before = sorted(p.name for p in folder.iterdir())
    dest = archive(folder, tmp_path, tmux_socket)
    assert dest is not None and is_run(Entry(name=Path(dest).name, kind="d", size=0, mtime=0))
    assert Path(dest).parent == folder / "archive"
    assert [p.name for p in folder.iterdir()] == ["archive"]
    assert sorted(p.name for p in Path(dest).iterdir()) == before
    assert (Path(dest) / "step-100" / "model.pt").read_bytes() == b"w" * 10

    (folder / "step-200").mkdir()
    second = archive(folder, tmp_path, tmux_socket)
    assert second is not None and second != dest
    assert sorted(p.name for p in Path(second).iterdir()) == ["step-200"]
    assert sorted(p.name for p in Path(dest).iterdir()) == before  # the first archive untouched


def test_archive_of_empty_or_missing_folder(tmp_path: Path, tmux_socket: str) -> None:
    assert archive(tmp_path / "missing", tmp_path, tmux_socket) is None
    assert not (tmp_path / "missing").exists()
    (tmp_path / "empty" / "archive").mkdir(parents=True)
    assert archive(tmp_path / "empty", tmp_path, tmux_socket) is None
    assert [p.name for p in (tmp_path / "empty").iterdir()] == ["archive"]


def test_list_live_and_archived(folder: Path, tmp_path: Path, tmux_socket: str) -> None:
    ck = checkpoints(folder)
    archive(folder, tmp_path, tmux_socket)
    (folder / "step-300").mkdir()
    listing = ck.list()
    assert [e.name for e in listing.live] == ["step-300"]
    ((stamp, entries),) = listing.archived.items()
    assert "step-100" in [e.name for e in entries]
    assert "odd name\nwith newline; $(x)" in [e.name for e in entries]


@pytest.mark.parametrize("path", ["/", "relative", "/a/../b", "", "/x\n/y"])
def test_unsafe_folders_are_refused(path: str) -> None:
    with pytest.raises(CheckpointPathError):
        checkpoints(path)


def test_list_gives_folders_the_size_of_what_they_hold(folder: Path) -> None:
    (folder / "step-100" / "state.pt").write_bytes(b"s" * 3_000_000)
    (folder / "tab\tname").mkdir()
    ck = checkpoints(folder)
    live = {e.name: e for e in ck.list().live}
    assert 3_000_000 <= live["step-100"].size < 3_200_000  # du, not the 4,096-byte entry
    assert live["metrics.jsonl"].size == len('{"step": 100}\n')  # files: their own size
    assert live["tab\tname"].kind == "d" and live["odd name\nwith newline; $(x)"].kind == "f"
    assert {e.name for e in ck.entries()} == set(live)  # without sizes: the same entries


def test_a_link_named_like_a_checkpoint_is_listed_as_left_alone(tmp_path: Path) -> None:
    """A `step-*` link beside the trainer's checkpoints (the trainer skips it too): listed as
    what it is, named in one warning, never followed to measure its size."""
    folder, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    (folder / "step-00000002").mkdir(parents=True)
    elsewhere.mkdir()
    (elsewhere / "big").write_bytes(b"x" * 1_000_000)
    (folder / "step-00000009").symlink_to(elsewhere)
    (folder / ".tmp-step-00000003-7").symlink_to(elsewhere)
    listing = checkpoints(folder).list()
    live = {e.name: e for e in listing.live}
    assert live["step-00000009"].kind == "l" and live["step-00000009"].size < 1_000_000
    assert listing.foreign == [
        f"left alone {folder}/.tmp-step-00000003-7: a symbolic link, not a checkpoint the "
        "trainer wrote",
        f"left alone {folder}/step-00000009: a symbolic link, not a checkpoint the trainer wrote",
    ]
