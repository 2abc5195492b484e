"""The deploy lock at a place (real files, real bash; local and over the loopback sshd):
atomic, names its holder, waits a bounded time, takes over stale locks with a warning."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dflash_ops.errors import LockHeld
from dflash_ops.lock import LOCK_NAME, DeployLock, Owner
from dflash_ops.place import HostPlace
from dflash_ops.transport import LocalTransport, SSHTransport


def record(**changes: object) -> str:
    base = Owner.me("deploy").__dict__ | changes
    return json.dumps(base)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "root"


def lock(root: Path, *, wait: float = 0.5, warnings: list[str] | None = None) -> DeployLock:
    sink = warnings if warnings is not None else []
    return DeployLock(HostPlace(LocalTransport()), str(root), wait=wait, warn=sink.append)


def test_second_holder_waits_then_fails_naming_the_first(root: Path) -> None:
    first = lock(root).acquire("deploy")
    owner = json.loads(str((root / LOCK_NAME).readlink()))
    assert owner["pid"] > 0 and owner["doing"] == "deploy" and "@" in owner["by"]
    started = time.monotonic()
    with pytest.raises(LockHeld) as err:
        lock(root, wait=0.6).acquire("restart")
    assert time.monotonic() - started >= 0.6
    assert f"pid {first.pid}" in str(err.value) and "deploy by " in str(err.value)
    assert "--force" in err.value.hint
    lock(root).release(first)
    assert not (root / LOCK_NAME).is_symlink()
    with lock(root).held("restart"):
        assert json.loads(str((root / LOCK_NAME).readlink()))["doing"] == "restart"
    assert not (root / LOCK_NAME).is_symlink()


def test_waiter_gets_the_lock_when_it_is_released(root: Path) -> None:
    first = lock(root).acquire("deploy")
    threading.Timer(0.5, lock(root).release, args=(first,)).start()
    second = lock(root, wait=5).acquire("stop")
    assert json.loads(str((root / LOCK_NAME).readlink()))["token"] == second.token


def test_stale_locks_are_taken_over_with_a_warning(root: Path) -> None:
    root.mkdir()
    (root / LOCK_NAME).symlink_to(record(pid=dead_pid()))  # this host, process gone
    warnings: list[str] = []
    lock(root, warnings=warnings).acquire("deploy")
    assert len(warnings) == 1 and "no longer exists" in warnings[0]

    (root / LOCK_NAME).unlink()
    (root / LOCK_NAME).symlink_to(record(host="elsewhere", by="ann@elsewhere", since=1.0))
    warnings.clear()
    lock(root, warnings=warnings).acquire("deploy")
    assert "old" in warnings[0] and "ann@elsewhere" in warnings[0]


def test_a_live_holder_elsewhere_is_not_stale_but_force_takes_over(root: Path) -> None:
    root.mkdir()
    # Another machine's pid cannot be checked from here: a missing local pid proves nothing.
    (root / LOCK_NAME).symlink_to(record(host="elsewhere", by="ann@elsewhere", pid=dead_pid()))
    with pytest.raises(LockHeld, match="ann@elsewhere"):
        lock(root, wait=0.2).acquire("deploy")
    warnings: list[str] = []
    owner = lock(root, warnings=warnings).acquire("deploy", force=True)
    assert "--force" in warnings[0] and "ann@elsewhere" in warnings[0]
    assert json.loads(str((root / LOCK_NAME).readlink()))["token"] == owner.token


def test_release_leaves_someone_elses_lock(root: Path) -> None:
    mine = lock(root).acquire("deploy")
    (root / LOCK_NAME).unlink()
    (root / LOCK_NAME).symlink_to(record(host="elsewhere"))
    lock(root).release(mine)
    assert (root / LOCK_NAME).is_symlink()


def test_only_one_of_many_concurrent_takers_holds_it(root: Path, ssh_home: object) -> None:
    """Four connections race for the lock over ssh; at every moment at most one holds it."""
    holding: list[str] = []
    overlaps: list[tuple[str, ...]] = []
    failures: list[BaseException] = []

    def worker(name: str) -> None:
        place = HostPlace(SSHTransport("testbox"))
        try:
            for _ in range(2):
                with DeployLock(place, str(root), wait=30).held(name):
                    holding.append(name)
                    if len(holding) > 1:
                        overlaps.append(tuple(holding))
                    time.sleep(0.05)
                    holding.remove(name)
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append(exc)
        finally:
            place.close()

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not failures and not overlaps
    assert not (root / LOCK_NAME).is_symlink()
