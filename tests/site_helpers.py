"""Drive the site program (`dflash_ops/remote/site.sh`) at a place through its client, the one
path production runs: a `Site` is a target's parts (releases, job, lock, checkpoints) under one
root, and its methods run the program's commands (deploy, rollback, restart, stop).

A test module takes the fixtures by importing `site_fixture` and `tmux_socket_fixture`."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from dflash_ops.connect.place import HostPlace, Place
from dflash_ops.connect.transport import LocalTransport
from dflash_ops.remote import client
from dflash_ops.remote.checkpoints import Checkpoints
from dflash_ops.remote.job import Job
from dflash_ops.remote.lock import DeployLock
from dflash_ops.remote.release import KEEP, Bundle, Releases


@dataclass
class Site:
    plan: client.DeployPlan
    warnings: list[str]

    @property
    def releases(self) -> Releases:
        return self.plan.releases

    @property
    def job(self) -> Job:
        return self.plan.job

    def with_(self, **changes: object) -> Site:
        """The same site with other plan values (`launch`, `env`, `cwd`, `keep`, `lock`)."""
        return Site(replace(self.plan, **changes), self.warnings)  # type: ignore[arg-type]

    def deploy(self, bundle: Bundle, *, archive: bool = False) -> client.Done:
        return client.run(self.plan, client.Steps(doing="deploy", bundle=bundle, archive=archive))

    def rollback(self, release: str, *, expect: str = "", force: bool = False) -> client.Done:
        steps = client.Steps(doing="rollback", switch_to=release)
        return client.run(self.plan, steps, expect=expect, force=force)

    def restart(self, *, archive: bool = False, force: bool = False) -> client.Done:
        return client.run(self.plan, client.Steps(doing="restart", archive=archive), force=force)

    def stop(self, *, save: bool = True, force: bool = False) -> client.Done:
        return client.run(self.plan, client.Steps(doing="stop", save=save), force=force)


def make_site(
    place: Place,
    root: Path,
    socket: str,
    *,
    launch: Sequence[str] = ("true",),
    lock_wait: float = 0.5,
    stop_timeout: float = 5.0,
    keep: int = KEEP,
    checkpoints: Path | None = None,
    log: Path | None = None,
) -> Site:
    """The target under `root` at `place` (checkpoints in `root/checkpoints` unless given, the
    job's log in the checkpoints folder unless given)."""
    checkpoints = checkpoints or root / "checkpoints"
    warnings: list[str] = []
    job = Job(
        place,
        session="dflash",
        log=str(log or checkpoints / "train_stdout.log"),
        socket=socket,
        stop_timeout=stop_timeout,
    )
    plan = client.DeployPlan(
        releases=Releases(place, str(root)),
        job=job,
        lock=DeployLock(place, str(root), wait=lock_wait, warn=warnings.append),
        checkpoints=Checkpoints(place, str(checkpoints)),
        launch=list(launch),
        cwd=str(root),
        env={},
        keep=keep,
    )
    return Site(plan, warnings)


@pytest.fixture(name="tmux_socket")
def tmux_socket_fixture() -> Iterator[str]:
    name = f"dflash-test-{uuid.uuid4().hex[:10]}"
    yield name
    os.system(f"tmux -L {name} kill-server >/dev/null 2>&1")


@pytest.fixture(name="site")
def site_fixture(tmp_path: Path, tmux_socket: str) -> Site:
    """A target under `tmp_path/root` on this machine, its job on a private tmux socket."""
    return make_site(HostPlace(LocalTransport()), tmp_path / "root", tmux_socket)


def start(
    site: Site,
    argv: Sequence[str],
    *,
    cwd: Path | str,
    env: dict[str, str],
    archive: bool = False,
) -> client.Done:
    """Start `argv` as the job: `restart` (stop, archive with `archive`, then start) with that
    command; `current` is made to point somewhere first when nothing is deployed (restart
    reads it)."""
    current = Path(site.releases.current_path)
    if not current.is_symlink():
        current.parent.mkdir(parents=True, exist_ok=True)
        current.symlink_to("releases/none")
    return site.with_(launch=list(argv), cwd=str(cwd), env=env).restart(archive=archive)
