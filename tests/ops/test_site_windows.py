"""The site program's narrow windows, made to happen on purpose: real tmux on this machine,
with the hostile tool (`tests/fixtures/hostile_tool/hostile`) first on PATH as tmux to make two
of its quirks happen at will: a dead pane shown without its exit status (tmux 3.3 misses a
SIGCHLD now and then, and the stop's short wait for the status then ends without it) and a
kill of a session that does not take effect.

- Both at once made a deploy stop the job, archive the checkpoints, then fail with `Job
  session … is already running`: the session the stop had not closed looked alive to the
  start. The kill is now checked and tried again, and the start judges a session by its
  process group; a kill that never takes fails the stop before anything is archived.
- `restart` removes the unfinished `releases/<id>.tmp` a killed deploy left, and nothing else.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dflash_ops.errors import DflashError
from tests.site_helpers import Site, site_fixture, start, tmux_socket_fixture  # noqa: F401

HOSTILE = Path(__file__).resolve().parents[1] / "fixtures" / "hostile_tool" / "hostile"


@pytest.fixture
def quirky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """tmux first on this machine's PATH, without its exit statuses, dropping the kills of a
    session while `tmux.drops` is above 0."""
    folder = tmp_path / "fakes"
    folder.mkdir()
    (folder / "tmux").symlink_to(HOSTILE)
    (folder / "tmux.mode").write_text("quirks")
    (folder / "tmux.quirks").write_text("no-kill no-status")
    (folder / "tmux.drops").write_text("0")
    monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")
    return folder


def running_with_a_checkpoint(site: Site, tmp_path: Path) -> Path:
    """The job runs (`sleep 600`) beside a checkpoint, which is returned."""
    start(site, ["sleep", "600"], cwd=tmp_path, env={})
    checkpoint = Path(site.plan.checkpoints.path) / "step-00000001"
    checkpoint.mkdir(parents=True)
    return checkpoint


@pytest.mark.slow  # tmux through a bash wrapper, read many times while the stop waits
def test_a_lost_kill_of_a_job_without_status_does_not_refuse_the_start(
    site: Site, tmp_path: Path, quirky: Path
) -> None:
    running_with_a_checkpoint(site, tmp_path)
    (quirky / "tmux.drops").write_text("1")  # the stop's kill of the session is lost
    done = site.with_(launch=["sleep", "601"]).restart(archive=True)
    assert (quirky / "tmux.drops").read_text().strip() == "0"  # it was dropped, then tried again
    assert done.stopped is not None and done.stopped.exit_code is None  # tmux never said
    assert done.archived is not None and done.started is not None and done.started.running
    assert site.job.state().running
    site.stop()


@pytest.mark.slow
def test_a_kill_that_never_takes_fails_the_stop_before_the_archive(
    site: Site, tmp_path: Path, quirky: Path
) -> None:
    checkpoint = running_with_a_checkpoint(site, tmp_path)
    (quirky / "tmux.drops").write_text("99")
    with pytest.raises(DflashError, match="was stopped, but tmux did not close its session") as e:
        site.with_(launch=["sleep", "601"]).restart(archive=True)
    assert "nothing was archived or started" in str(e.value) and "kill-session" in e.value.hint
    assert checkpoint.is_dir()  # nothing was archived
    (quirky / "tmux.drops").write_text("0")
    site.stop()


def test_restart_removes_what_killed_deploys_left_and_nothing_else(
    site: Site, tmp_path: Path
) -> None:
    start(site, ["sleep", "600"], cwd=tmp_path, env={})
    releases = Path(site.releases.root) / "releases"
    stale = releases / "20260101-000000-000-abcd.tmp"
    (stale / "trainer").mkdir(parents=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep").write_text("x")
    link = releases / "20260101-000000-001-abcd.tmp"
    link.symlink_to(elsewhere)
    other = releases / "notes.tmp"
    other.mkdir()
    done = site.restart()
    assert done.cleaned == sorted([stale.name, link.name])
    assert not stale.exists() and not link.is_symlink() and (elsewhere / "keep").exists()
    assert other.is_dir()
    site.stop()


def wait_for(predicate, timeout: float = 20.0) -> None:  # type: ignore[no-untyped-def]
    import time

    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end
        time.sleep(0.02)
