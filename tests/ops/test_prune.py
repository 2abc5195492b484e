"""`checkpoints prune`: deletes archived runs only, and every deletion proves at the place that
its resolved path lies inside `<checkpoints>/archive/` — locally and over the loopback sshd."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_ops.connect.place import HostPlace
from dflash_ops.connect.transport import LocalTransport, SSHTransport
from dflash_ops.remote.checkpoints import Checkpoints
from dflash_ops.remote.client import prune_runs, site_argv


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
    report = prune_runs(Checkpoints(place, str(ckpt)), keep=1)
    assert report.deleted == ["20260101T000000.000Z", "20260102T000000.000Z"]
    assert report.kept == ["20260103T000000.000Z"] and not report.refused
    assert sorted(p.name for p in (ckpt / "archive").iterdir()) == ["20260103T000000.000Z"]
    assert (ckpt / "step-9").is_dir()
    assert prune_runs(Checkpoints(place, str(ckpt)), keep=0).deleted == ["20260103T000000.000Z"]
    assert (ckpt / "step-9").is_dir()


def test_symlinks_are_never_followed_and_the_canary_survives(
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
    (ckpt / "archive" / "19990101T000000.000Z").symlink_to(outside / "run")  # named as a run
    report = prune_runs(Checkpoints(place, str(ckpt)), keep=0)
    assert report.deleted == ["20260101T000000.000Z"] and not report.refused
    assert len(report.skipped) == 5 and all("a symbolic link" in m for m in report.skipped)
    assert canary.read_text() == "alive" and Path("/usr").is_dir()
    assert sorted(p.name for p in (ckpt / "archive").iterdir()) == [
        "00-escape", "01-root", "02-dotdot", "03-dangling", "19990101T000000.000Z",
    ]  # fmt: skip


def runs_of(ckpt: Path) -> dict[str, bytes]:
    """Every archived run's files (what a prune may lose), by path below archive/."""
    return {
        str(f.relative_to(ckpt / "archive")): f.read_bytes()
        for f in (ckpt / "archive").glob("2*/step-1/model.pt")
        if not f.parent.parent.is_symlink()
    }


# Trees as the reports found them: a link named as an old run pointing at the newest run, the
# evaluator's demo assets in archive/, stray folders and files beside the runs.
PRUNE_TREES = {
    "link-to-newest": {"20250101T000007.000Z": "20991231T000000.000Z"},
    "link-to-every-run": {f"20250101T00000{i}.000Z": "20260101T00000{i}.000Z" for i in range(4)},
    "demo-assets": {"demo-assets/": None},
    "stray": {"notes.txt": None, "2026-01-01/": None, "20260101T000000Z/": None, ".hidden/": None},
    "everything": {
        "20250101T000007.000Z": "20991231T000000.000Z",
        "demo-assets/": None,
        "zz": "/",
        "latest": "20260101T000003.000Z",
    },
}


@pytest.mark.parametrize("tree", sorted(PRUNE_TREES))
@pytest.mark.parametrize("keep", [0, 1, 2])
def test_prune_never_loses_a_run_it_must_keep(
    place: HostPlace, tmp_path: Path, tree: str, keep: int
) -> None:
    ckpt = tmp_path / "ckpt"
    runs = ["20260101T000000.000Z", "20260101T000001.000Z", "20260101T000002.000Z",
            "20260101T000003.000Z", "20991231T000000.000Z"]  # fmt: skip
    make_archive(ckpt, runs)
    for name, link in PRUNE_TREES[tree].items():
        path = ckpt / "archive" / name.rstrip("/")
        if link is not None:
            path.symlink_to(link)
        elif name.endswith("/"):
            (path / "target").mkdir(parents=True)
            (path / "target" / "model.safetensors").write_bytes(b"t")
        else:
            path.write_text("x")
    before = runs_of(ckpt)
    report = prune_runs(Checkpoints(place, str(ckpt)), keep=keep)
    newest = runs[len(runs) - keep :] if keep else []
    assert report.kept == newest and report.deleted == runs[: len(runs) - keep]
    assert not report.refused and len(report.skipped) == len(PRUNE_TREES[tree])
    after = runs_of(ckpt)
    assert {k: v for k, v in before.items() if k.split("/")[0] in newest} == after
    for name in PRUNE_TREES[tree]:  # what is not a run is all still there, untouched
        path = ckpt / "archive" / name.rstrip("/")
        assert path.is_symlink() or path.exists()
        if name.endswith("/"):
            assert (path / "target" / "model.safetensors").read_bytes() == b"t"


def test_the_place_side_proof_refuses_what_is_not_a_run(place: HostPlace, tmp_path: Path) -> None:
    """The deletion command alone, handed entries that are not runs: each is refused."""
    ckpt = tmp_path / "ckpt"
    make_archive(ckpt, ["20260101T000000.000Z"])
    link = ckpt / "archive" / "20250101T000000.000Z"
    link.symlink_to("20260101T000000.000Z")
    (ckpt / "archive" / "demo-assets").mkdir()
    for entry, why in ((link, "symbolic link"), (ckpt / "archive" / "demo-assets", "not a run")):
        result = place.run(
            site_argv("prune-run", [("checkpoints", str(ckpt)), ("run", str(entry))]), check=False
        )
        assert result.exit_code == 3 and why in result.stderr_text, result.stderr_text
    assert (ckpt / "archive" / "20260101T000000.000Z" / "step-1" / "model.pt").exists()
    assert link.is_symlink() and (ckpt / "archive" / "demo-assets").is_dir()


def test_archive_folder_that_is_a_symlink_out_is_refused(place: HostPlace, tmp_path: Path) -> None:
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    make_archive(elsewhere, ["20260101T000000.000Z"])
    ckpt.mkdir()
    (ckpt / "archive").symlink_to(elsewhere / "archive")
    report = prune_runs(Checkpoints(place, str(ckpt)), keep=0)
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
            site_argv("prune-run", [("checkpoints", str(link)), ("run", candidate)]), check=False
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
    assert pruned.returncode == 0, pruned.stderr  # the link is not a run: left alone
    assert "Deleted archived run 20260101T000000.000Z" in pruned.stderr
    assert "left alone" in pruned.stderr and "00-link: a symbolic link" in pruned.stderr
    assert (outside / "canary").read_text() == "alive" and (ckpt / "step-5").is_dir()
    assert sorted(p.name for p in (ckpt / "archive").iterdir()) == [
        "00-link",
        "20260102T000000.000Z",
    ]
