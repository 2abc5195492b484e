"""`checkpoints prune`: only runs holding a verified checkpoint count among the N kept, the newest
of them is never deleted while the live folder has none, every verdict is shown before anything
goes and a deletion is asked for (`--yes`, `--dry-run`); each deletion proves at the place that
it deletes an archived run. On this machine, over the loopback sshd and in a container of the
`pct` stand-in; the verdicts come from the trainer's own verification at the place."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dflash_ops.commands import prune as pruning
from dflash_ops.commands.workspace import Workspace
from dflash_ops.connect.place import HostPlace
from dflash_ops.connect.transport import LocalTransport, SSHTransport
from dflash_ops.remote.checkpoints import Checkpoints, Run, choose
from dflash_ops.remote.client import delete_runs, site_argv
from dflash_ops.settings.deploy_config import TargetFlags
from tests.cli_helpers import REPO, Where, any_where
from tests.pty_helpers import Terminal
from trainer.model.checkpoint import save_checkpoint
from trainer.settings.loading import config_from_dict

CFG = config_from_dict({"model": {"target": "/m/t"}, "data": {"path": "/d/x.jsonl"}})
CT = 231
RUNS = ["20260101T000000.000Z", "20260101T000001.000Z", "20260101T000002.000Z",
        "20260101T000003.000Z", "20991231T000000.000Z"]  # fmt: skip


@pytest.fixture(params=["local", "ssh"])
def place(request: pytest.FixtureRequest) -> HostPlace:
    if request.param == "local":
        return HostPlace(LocalTransport())
    request.getfixturevalue("ssh_home")
    return HostPlace(SSHTransport("testbox"))


def save_run(run: Path, steps: tuple[int, ...] = (1,)) -> None:
    """Real checkpoints, as the trainer writes them (state.pt, manifest with its sha256)."""
    for step in steps:
        save_checkpoint(run, step, {"w": torch.full((64,), float(step))}, CFG, keep_last=10)


def make_archive(ckpt: Path, stamps: list[str]) -> None:
    for stamp in stamps:
        save_run(ckpt / "archive" / stamp)


@pytest.fixture(params=["local", "ssh", "proxmox"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Where]:
    """A project with trainer/ whose job (a shell command) was deployed once, so that the
    place has a current release: its trainer verifies the checkpoints."""
    places = any_where(request, tmp_path, CT, python=sys.executable)
    spot = next(places)
    shutil.copytree(
        REPO / "trainer", spot.project / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    spot.config("echo started")
    deployed = spot.run("deploy", *spot.flags)
    assert deployed.returncode == 0, deployed.stderr
    yield spot
    next(places, None)  # the place's teardown


def workspace(where: Where) -> Workspace:
    """The Workspace a command run in the project folder gets (the remembered target)."""
    return Workspace.load(config_file=where.project / "deploy.toml", flags=TargetFlags())


def archived(where: Where) -> list[str]:
    folder = where.checkpoints / "archive"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_prune_keeps_the_run_with_checkpoints_and_deletes_the_junk(where: Where) -> None:
    """The reported case: a crash log (121 bytes) and a run without checkpoints (1 MB) were
    newer than the run that held step 101 and step 172; `--keep 2` deleted that one."""
    save_run(where.checkpoints, (101, 172))
    where.config("echo 'Traceback (most recent call last): ModuleNotFoundError: numpy'; exit 1")
    # --no-wait: the job ends as soon as it prints, so a deploy that waited would say so or not
    # depending on which of the two it saw first; here only the archive counts
    assert where.run("deploy", "--no-wait").returncode == 0  # archives the run that trained
    where.wait_exited()
    assert where.run("deploy", "--no-wait").returncode == 0  # archives the crash log
    where.wait_exited()
    (where.checkpoints / "metrics.jsonl").write_bytes(b"x" * 1_000_000)  # no checkpoint
    where.config("echo started")
    assert where.run("deploy").returncode == 0  # archives the run without checkpoints
    good, crash, junk = archived(where)

    dry = where.run("checkpoints", "prune", "--keep", "2", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert archived(where) == [good, crash, junk]
    rows = {line.split()[0]: line for line in dry.stdout.splitlines() if line[:1].isdigit()}
    assert "step-00000172" in rows[good] and "keep" in rows[good]
    assert "delete: no verified checkpoint" in rows[crash] and "1.0 MB" in rows[junk]
    assert "would delete 2 archived runs" in dry.stderr

    pruned = where.run("checkpoints", "prune", "--keep", "2", "--yes")
    assert pruned.returncode == 0, pruned.stderr
    assert archived(where) == [good]
    assert sorted(p.name for p in (where.checkpoints / "archive" / good).glob("step-*")) == [
        "step-00000101", "step-00000172",
    ]  # fmt: skip


def test_the_newest_run_with_a_checkpoint_stays_even_with_keep_0(where: Where) -> None:
    make_archive(where.checkpoints, RUNS[:3])
    (where.checkpoints / "archive" / RUNS[3]).mkdir()  # newer, without a checkpoint
    plan = pruning.plan(workspace(where), keep=0)
    assert plan.live is None  # the live folder holds only the new job's log
    assert [r.stamp for r in plan.kept] == [RUNS[2]]
    report = pruning.execute(workspace(where), plan)
    assert sorted(report.deleted) == [RUNS[0], RUNS[1], RUNS[3]] and not report.refused
    assert archived(where) == [RUNS[2]]

    save_run(where.checkpoints, (5,))  # now the live folder has one: keep 0 keeps nothing
    plan = pruning.plan(workspace(where), keep=0)
    assert plan.live == "step-00000005" and [r.stamp for r in plan.doomed] == [RUNS[2]]


def test_a_torn_checkpoint_does_not_count(where: Where) -> None:
    make_archive(where.checkpoints, RUNS[:2])
    state = where.checkpoints / "archive" / RUNS[1] / "step-00000001" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])  # its sha256 no longer matches the manifest
    plan = pruning.plan(workspace(where), keep=1)
    assert [(v.run.stamp, v.keep, v.why) for v in plan.verdicts] == [
        (RUNS[1], False, "no verified checkpoint"),
        (RUNS[0], True, "one of the 1 newest with a checkpoint"),
    ]


def test_prune_asks_at_a_terminal_and_refuses_without_one(where: Where) -> None:
    if where.kind != "local":
        pytest.skip("the question is asked here, whatever the place")
    make_archive(where.checkpoints, RUNS[:2])
    piped = where.run("checkpoints", "prune", "--keep", "1")
    assert piped.returncode == 1 and "Not deleting: nobody to ask" in piped.stderr
    assert "hint: Pass --yes" in piped.stderr and archived(where) == RUNS[:2]

    argv = [sys.executable, "-m", "dflash_ops", "checkpoints", "prune", "--keep", "1"]
    for answer, left in (("n", RUNS[:2]), ("y", RUNS[1:2])):
        term = Terminal(argv, cwd=where.project, env={"PYTHONPATH": str(REPO)})
        try:
            term.read_until(r"Delete 1 archived run \(.*\)\? \[y/N\]")
            term.type(answer + "\r")
            code = term.wait()
        finally:
            term.close()
        assert code == (1 if answer == "n" else 0), term.text
        assert archived(where) == left


def test_choose_counts_only_runs_with_a_checkpoint() -> None:
    runs = [Run(stamp=s, size=1, checkpoint="step-00000001" if i % 2 else None)
            for i, s in enumerate(RUNS)]  # fmt: skip
    for keep in range(4):
        for live in (None, "step-00000009"):
            verdicts = choose(runs, keep=keep, live=live)
            kept = [v.run.stamp for v in verdicts if v.keep]
            with_one = [r.stamp for r in reversed(runs) if r.checkpoint]
            wanted = with_one[: max(keep, 1 if live is None else 0)]
            assert kept == wanted, (keep, live)
            assert all(v.run.checkpoint for v in verdicts if v.keep)


def runs_of(ckpt: Path) -> dict[str, bytes]:
    """Every archived run's files (what a prune may lose), by path below archive/."""
    return {
        str(f.relative_to(ckpt / "archive")): f.read_bytes()
        for f in (ckpt / "archive").glob("2*/step-*/*")
        if not f.parent.parent.is_symlink()
    }


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
    checkpoints = Checkpoints(place, str(ckpt))
    runs, skipped = checkpoints.archived()
    assert [r.name for r in runs] == ["20260101T000000.000Z"]
    assert len(skipped) == 5 and all("a symbolic link" in m for m in skipped)
    report = delete_runs(checkpoints, [r.name for r in runs])
    assert report.deleted == ["20260101T000000.000Z"] and not report.refused
    assert canary.read_text() == "alive" and Path("/usr").is_dir()
    assert sorted(p.name for p in (ckpt / "archive").iterdir()) == [
        "00-escape", "01-root", "02-dotdot", "03-dangling", "19990101T000000.000Z",
    ]  # fmt: skip


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
def test_prune_never_loses_a_run_it_must_keep(where: Where, tree: str) -> None:
    if where.kind == "proxmox" and tree != "everything":
        pytest.skip("one tree in the container: the place's commands are the same")
    ckpt = where.checkpoints
    for keep in (0, 1, 2):
        shutil.rmtree(ckpt / "archive", ignore_errors=True)
        make_archive(ckpt, RUNS)
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
        plan = pruning.plan(workspace(where), keep=keep)
        newest = RUNS[len(RUNS) - max(keep, 1) :]  # the live folder has no checkpoint: 1 stays
        assert sorted(r.stamp for r in plan.kept) == newest
        assert len(plan.skipped) == len(PRUNE_TREES[tree])
        report = pruning.execute(workspace(where), plan)
        assert sorted(report.deleted) == RUNS[: len(RUNS) - max(keep, 1)] and not report.refused
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
    assert (ckpt / "archive" / "20260101T000000.000Z" / "step-00000001" / "state.pt").exists()
    assert link.is_symlink() and (ckpt / "archive" / "demo-assets").is_dir()


def test_archive_folder_that_is_a_symlink_out_is_refused(place: HostPlace, tmp_path: Path) -> None:
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    make_archive(elsewhere, ["20260101T000000.000Z"])
    ckpt.mkdir()
    (ckpt / "archive").symlink_to(elsewhere / "archive")
    report = delete_runs(Checkpoints(place, str(ckpt)), ["20260101T000000.000Z"])
    assert report.deleted == [] and "archive folder resolves" in report.refused[0]
    assert (elsewhere / "archive" / "20260101T000000.000Z" / "step-00000001" / "state.pt").exists()


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
