"""`checkpoints prune`: deletes archived runs only, and every deletion proves at the place that
its resolved path lies inside `<checkpoints>/archive/` — locally and over the loopback sshd."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_ops.checkpoints import _REMOVE_ARCHIVED, Checkpoints
from dflash_ops.place import HostPlace
from dflash_ops.transport import LocalTransport, SSHTransport


@pytest.fixture(params=["local", "ssh"])
def place(request: pytest.FixtureRequest) -> HostPlace:
    if request.param == "local":
        return HostPlace(LocalTransport())
    request.getfixturevalue("ssh_home")
    return HostPlace(SSHTransport("testbox"))


def make_archive(ckpt: Path, stamps: list[str]) -> None:
    for stamp in stamps:
        (ckpt / "archive" / stamp / "step-1").mkdir(parents=True)
        (ckpt / "archive" / stamp / "step-1" / "model.pt").write_bytes(b"w")


def test_prune_keeps_newest_and_never_touches_live(place: HostPlace, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    make_archive(ckpt, ["20260101T000000.000Z", "20260102T000000.000Z", "20260103T000000.000Z"])
    (ckpt / "step-9").mkdir()
    report = Checkpoints(place, str(ckpt)).prune(keep=1)
    assert report.deleted == ["20260101T000000.000Z", "20260102T000000.000Z"]
    assert report.kept == ["20260103T000000.000Z"] and not report.refused
    assert sorted(p.name for p in (ckpt / "archive").iterdir()) == ["20260103T000000.000Z"]
    assert (ckpt / "step-9").is_dir()
    assert Checkpoints(place, str(ckpt)).prune(keep=0).deleted == ["20260103T000000.000Z"]
    assert (ckpt / "step-9").is_dir()


def test_symlink_escapes_are_refused_and_the_canary_survives(
    place: HostPlace, tmp_path: Path
) -> None:
    ckpt, outside = tmp_path / "ckpt", tmp_path / "outside"
    make_archive(ckpt, ["20260101T000000.000Z"])
    (outside / "run").mkdir(parents=True)
    canary = outside / "run" / "canary"
    canary.write_text("alive")
    (ckpt / "archive" / "00-escape").symlink_to(outside / "run")  # a link out of the archive
    (ckpt / "archive" / "01-root").symlink_to("/")
    (ckpt / "archive" / "02-dotdot").symlink_to("..")  # the checkpoints folder itself
    (ckpt / "archive" / "03-dangling").symlink_to(tmp_path / "nothing")
    report = Checkpoints(place, str(ckpt)).prune(keep=0)
    assert report.deleted == ["20260101T000000.000Z"]
    assert len(report.refused) == 4
    assert all(m.startswith("refusing to delete ") for m in report.refused)
    assert "outside" in report.refused[0] and str(outside / "run") in report.refused[0]
    assert canary.read_text() == "alive" and Path("/usr").is_dir()
    assert (ckpt / "archive").is_dir()


def test_archive_folder_that_is_a_symlink_out_is_refused(place: HostPlace, tmp_path: Path) -> None:
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    make_archive(elsewhere, ["20260101T000000.000Z"])
    ckpt.mkdir()
    (ckpt / "archive").symlink_to(elsewhere / "archive")
    report = Checkpoints(place, str(ckpt)).prune(keep=0)
    assert report.deleted == [] and "archive folder resolves" in report.refused[0]
    assert (elsewhere / "archive" / "20260101T000000.000Z" / "step-1" / "model.pt").exists()


def test_checkpoints_folder_resolving_to_root_is_refused(place: HostPlace, tmp_path: Path) -> None:
    """The deletion command itself, with a checkpoints folder that is a link to `/`."""
    link = tmp_path / "ck-root"
    link.symlink_to("/")
    victim = tmp_path / "victim"
    victim.mkdir()
    for candidate in (str(victim), "", "/", f"{link}/archive/.."):
        result = place.run(
            ["bash", "-c", _REMOVE_ARCHIVED, "dflash-prune", str(link), candidate], check=False
        )
        assert result.exit_code == 3 and "refusing to delete" in result.stderr_text
    assert victim.is_dir() and Path("/usr").is_dir()


def test_prune_through_the_cli(tmp_path: Path) -> None:
    from tests.cli_helpers import dflash

    project = tmp_path / "project"
    project.mkdir()
    (project / "deploy.toml").write_text('[job]\nsocket = "dft-prune"\ncommand = "true"\n')
    ckpt = project / ".dflash" / "local" / "checkpoints"
    make_archive(ckpt, ["20260101T000000.000Z", "20260102T000000.000Z"])
    (ckpt / "step-5").mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "canary").write_text("alive")
    (ckpt / "archive" / "00-link").symlink_to(outside)

    listed = dflash(project, "checkpoints")
    assert listed.returncode == 0 and "step-5/" in listed.stdout
    pruned = dflash(project, "checkpoints", "prune", "--keep", "1")
    assert pruned.returncode == 1, pruned.stderr  # one entry was refused
    assert "Deleted archived run 20260101T000000.000Z" in pruned.stderr
    assert "refusing to delete" in pruned.stderr and str(outside) in pruned.stderr
    assert (outside / "canary").read_text() == "alive" and (ckpt / "step-5").is_dir()
    assert sorted(p.name for p in (ckpt / "archive").iterdir()) == [
        "00-link",
        "20260102T000000.000Z",
    ]
