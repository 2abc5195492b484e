"""Releases with their completion marker, keep-last-5, `dflash releases`, `dflash rollback`,
and two deploys at once, on the local place (real tar, real tmux, the real CLI)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_ops.errors import ReleaseError
from dflash_ops.remote.release import COMPLETE
from tests.cli_helpers import REPO, Where, kill_tmux_server, wait_for
from tests.ops.test_release import plan, push
from tests.site_helpers import Site, site_fixture, tmux_socket_fixture  # noqa: F401


@pytest.fixture
def project(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    (folder / "trainer").mkdir(parents=True)
    (folder / "trainer" / "__main__.py").write_text("print('train')\n")
    return folder


def test_only_marked_releases_count(site: Site, tmp_path: Path, project: Path) -> None:
    releases = site.releases
    good = push(site, project)
    assert (tmp_path / "root" / "releases" / good / COMPLETE).is_file()
    unmarked = plan().release_id  # unpacked by hand, never marked complete
    (tmp_path / "root" / "releases" / unmarked).mkdir()
    assert releases.list() == [good]
    with pytest.raises(ReleaseError, match="not complete"):
        site.rollback(unmarked)
    assert releases.current() == good


def test_keep_five_spares_current_and_rollback_target(site: Site, project: Path) -> None:
    releases = site.releases
    ids = [push(site, project) for _ in range(3)]
    site.rollback(ids[0], expect=ids[2])  # rolled back to the oldest
    assert releases.current() == ids[0]
    later = [push(site, project) for _ in range(6)]
    # current is the newest; `rollback` goes to the one deployed before it
    assert releases.list() == sorted(later)[-5:]
    assert releases.rollback_target() == later[-2]


def test_rollback_refuses_when_current_moved_meanwhile(site: Site, project: Path) -> None:
    """Rollback chose its target from `current` as it was read; a deploy since then wins."""
    ids = [push(site, project) for _ in range(3)]
    with pytest.raises(ReleaseError) as refused:
        site.rollback(ids[0], expect=ids[1])
    said = str(refused.value)
    assert f"was switched to {ids[2]} by another command" in said and "nothing was" in said
    assert "run dflash rollback again" in refused.value.hint.lower()
    assert "must be a symlink" not in refused.value.hint
    assert site.releases.current() == ids[2]
    assert not Path(site.plan.lock.path).is_symlink()


@pytest.fixture
def local(tmp_path: Path) -> Iterator[Where]:
    project = tmp_path / "project"
    project.mkdir()
    root = project / ".dflash" / "local"
    spot = Where("local", project, [], root, root / "checkpoints", f"dft-{uuid.uuid4().hex[:10]}")
    yield spot
    kill_tmux_server(spot.socket)


def test_releases_and_rollback_through_the_cli(local: Where) -> None:
    local.config('echo "run of $DFLASH_RELEASE"; sleep 30')
    assert local.run("deploy").returncode == 0
    assert local.run("deploy", "--resume").returncode == 0
    first, second = local.releases()
    listing = json.loads(local.run("releases", "--json").stdout)
    assert [r["id"] for r in listing["releases"]] == [first, second]
    assert [r["current"] for r in listing["releases"]] == [False, True]
    assert all(r["size"] > 0 and r["created"] for r in listing["releases"])
    assert listing["releases"][0]["revision"] != ""
    human = local.run("releases").stdout.splitlines()
    assert human[1].split()[0] == first and human[2].split()[:2] == ["*", second]

    rolled = local.run("rollback")
    assert rolled.returncode == 0, rolled.stderr
    assert os.readlink(local.root / "current") == f"releases/{first}"
    log = local.checkpoints / "train_stdout.log"
    assert wait_for(log, f"run of {first}").count(f"run of {first}") == 2  # resumed: same log
    assert local.status()["running"] and local.status()["release"] == first

    assert local.run("rollback", "--to", second).returncode == 0
    assert local.status()["release"] == second
    bad = local.run("rollback", "--to", "20200101-000000-000-abcd")
    assert bad.returncode == 1 and "not a complete release" in bad.stderr
    assert local.run("stop").returncode == 0


def start(where: Where, *args: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_ops", *args],
        cwd=where.project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_deploys_at_once_one_fails_naming_the_other(local: Where) -> None:
    # The running job ignores SIGINT/SIGTERM: stopping it holds a deploy for stop_timeout (3 s).
    local.config("trap '' INT TERM; echo up; sleep 60", extra="lock_wait = 0.5\n")
    assert local.run("deploy").returncode == 0
    wait_for(local.checkpoints / "train_stdout.log", "up")
    a, b = start(local, "deploy", "--resume"), start(local, "deploy", "--resume")
    (_, a_err), (_, b_err) = a.communicate(60), b.communicate(60)
    codes = sorted([a.returncode, b.returncode])
    assert codes == [0, 1], (a_err, b_err)
    winner, loser_err = (a, b_err) if a.returncode == 0 else (b, a_err)
    assert "deploy lock" in loser_err and "deploy by " in loser_err
    assert f"pid {winner.pid}" in loser_err and "--force" in loser_err
    assert len(local.releases()) == 2  # the loser built nothing at the place
    assert not (local.root / "deploy.lock").is_symlink()
    wait_for(local.checkpoints / "train_stdout.log", "up")
    assert local.run("stop").returncode == 0


def test_stop_restart_rollback_wait_for_the_lock_and_force_takes_it(local: Where) -> None:
    local.config("echo up; exec sleep 30", extra="lock_wait = 0.3\n")
    local.root.mkdir(parents=True)
    holder = {"by": "ann@laptop", "host": "laptop", "pid": 4242, "since": time.time(),
              "doing": "deploy", "token": "feedbeef"}  # fmt: skip
    (local.root / "deploy.lock").symlink_to(json.dumps(holder))
    ids = ["20260101-000000-000-aaaa", "20260102-000000-000-bbbb"]
    for release_id in ids:  # rollback chooses its target before its command takes the lock
        (local.root / "releases" / release_id).mkdir(parents=True)
        (local.root / "releases" / release_id / ".complete").touch()
    (local.root / "current").symlink_to(f"releases/{ids[1]}")
    for command in ("stop", "restart", "rollback"):
        held = local.run(command)
        assert held.returncode == 1 and "deploy by ann@laptop (pid 4242)" in held.stderr
        assert "--force" in held.stderr
    forced = local.run("stop", "--force")
    assert forced.returncode == 0 and "Taking over the deploy lock" in forced.stderr
    assert "ann@laptop" in forced.stderr and not (local.root / "deploy.lock").is_symlink()
