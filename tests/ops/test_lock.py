"""The deploy lock at a place, taken by the site program inside each changing command (real
files, real bash, real tmux; local and over the loopback sshd): atomic, names its holder, waits
a bounded time, takes over stale locks with a warning, never removes a lock that is not its own."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dflash_ops.connect.place import HostPlace
from dflash_ops.connect.transport import LocalTransport, SSHTransport
from dflash_ops.errors import LockHeld
from dflash_ops.remote.lock import LOCK_NAME, Owner
from tests.site_helpers import (  # noqa: F401 - fixtures
    Site,
    make_site,
    start,
    tmux_socket_fixture,
)


def record(**changes: object) -> str:
    base = Owner.me("deploy").__dict__ | changes
    return json.dumps(base)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "root"
    folder.mkdir()
    return folder


def site(root: Path, socket: str, *, wait: float = 0.5) -> Site:
    return make_site(HostPlace(LocalTransport()), root, socket, lock_wait=wait)


def test_a_live_holder_makes_the_command_wait_then_fail_naming_it(
    root: Path, tmux_socket: str
) -> None:
    held = record()  # this process: alive
    (root / LOCK_NAME).symlink_to(held)
    started = time.monotonic()
    with pytest.raises(LockHeld) as err:
        site(root, tmux_socket, wait=0.6).stop()
    assert time.monotonic() - started >= 0.6
    assert f"pid {os.getpid()}" in str(err.value) and "deploy by " in str(err.value)
    assert "--force" in err.value.hint
    assert os.readlink(root / LOCK_NAME) == held  # untouched
    (root / LOCK_NAME).unlink()
    site(root, tmux_socket).stop()
    assert not (root / LOCK_NAME).is_symlink()  # taken and released by the program


def test_a_waiter_gets_the_lock_when_it_is_released(root: Path, tmux_socket: str) -> None:
    (root / LOCK_NAME).symlink_to(record())
    threading.Timer(0.5, (root / LOCK_NAME).unlink).start()
    waiter = site(root, tmux_socket, wait=5)
    waiter.stop()
    assert waiter.warnings == [] and not (root / LOCK_NAME).is_symlink()


def test_stale_locks_are_taken_over_with_a_warning(root: Path, tmux_socket: str) -> None:
    (root / LOCK_NAME).symlink_to(record(pid=dead_pid()))  # this host, process gone
    first = site(root, tmux_socket)
    first.stop()
    assert len(first.warnings) == 1 and "no longer exists" in first.warnings[0]

    (root / LOCK_NAME).symlink_to(record(host="elsewhere", by="ann@elsewhere", since=1.0))
    second = site(root, tmux_socket)
    second.stop()
    assert "old" in second.warnings[0] and "ann@elsewhere" in second.warnings[0]
    assert not (root / LOCK_NAME).is_symlink()


def test_a_live_holder_elsewhere_is_not_stale_but_force_takes_over(
    root: Path, tmux_socket: str
) -> None:
    # Another machine's pid cannot be checked from here: a missing local pid proves nothing.
    (root / LOCK_NAME).symlink_to(record(host="elsewhere", by="ann@elsewhere", pid=dead_pid()))
    with pytest.raises(LockHeld, match="ann@elsewhere"):
        site(root, tmux_socket, wait=0.2).stop()
    forced = site(root, tmux_socket)
    forced.stop(force=True)
    assert "--force" in forced.warnings[0] and "ann@elsewhere" in forced.warnings[0]
    assert not (root / LOCK_NAME).is_symlink()


def test_the_program_leaves_a_lock_that_is_no_longer_its_own(
    root: Path, tmux_socket: str, tmp_path: Path
) -> None:
    """While `stop` holds the lock, its SIGINT makes the job put another record in its place:
    the program's exit leaves that record alone."""
    other = record(host="elsewhere")
    script = (
        """trap 'ln -sfn -- "$OTHER" "$LOCK"; exit 0' INT; touch up; while :; do sleep 0.05; done"""
    )
    env = {"OTHER": other, "LOCK": str(root / LOCK_NAME)}
    here = site(root, tmux_socket)
    start(here, ["bash", "-c", script], cwd=tmp_path, env=env)
    end = time.monotonic() + 10
    while not (tmp_path / "up").exists() and time.monotonic() < end:
        time.sleep(0.05)
    here.stop()
    assert os.readlink(root / LOCK_NAME) == other


def test_only_one_of_many_concurrent_commands_holds_it(
    root: Path, tmp_path: Path, tmux_socket: str, ssh_home: object
) -> None:
    """Four connections run `stop` twice each over ssh; every run waits its turn (none takes a
    live lock over), and each program's own record is the one it removes."""
    failures: list[BaseException] = []
    warnings: list[str] = []

    def worker() -> None:
        place = HostPlace(SSHTransport("testbox"))
        try:
            one = make_site(place, root, tmux_socket, lock_wait=30)
            for _ in range(2):
                one.stop()
            warnings.extend(one.warnings)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
        finally:
            place.close()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures and not warnings
    assert not (root / LOCK_NAME).is_symlink()
    assert not list(root.glob(f"{LOCK_NAME}*"))  # no record left aside
