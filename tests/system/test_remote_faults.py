"""Remote work never outlives its authority, with real parts (loopback sshd, the `pct`
stand-in, real tmux):

- A: `dflash deploy` SIGKILLed while its stop step waits for a job that ignores SIGINT, then
  `dflash restart` at once: the killed command's script ends with its connection, so the new
  job still runs afterwards (it once ended it, finishing its stop step on the new session).
- C: a lock whose recorded pids belong to another live process: taken over when the script it
  names is gone (a reused pid has another start time), refused naming the holder while it lives.

Rerun: .venv/bin/python -m pytest -q tests/system/test_remote_faults.py
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dflash_ops.remote.lock import LOCK_NAME
from tests.cli_helpers import REPO, Where, kill_tmux_server, remote_where

CT = 246
# Logs each SIGINT and carries on: only the SIGTERM after `stop_timeout` (3 s) ends it.
STUBBORN = "trap 'echo got-int' INT; echo up; while :; do sleep 0.1; done"


@pytest.fixture(params=["ssh", "proxmox"])
def remote(request: pytest.FixtureRequest, tmp_path: Path, ssh_home: object) -> Iterator[Where]:
    yield from remote_where(request, tmp_path, CT)


def wait_for(predicate, what: str, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"never saw {what}"
        time.sleep(0.02)


def log_text(where: Where) -> str:
    log = where.checkpoints / "train_stdout.log"
    return "\n" + log.read_text(errors="replace") if log.exists() else ""


def log_has(where: Where, text: str) -> bool:
    return text in log_text(where)


def processes(match: Callable[[list[bytes]], bool]) -> list[int]:
    """Pids of the processes on this machine whose argv `match` accepts (ssh sessions and the
    stand-in containers both run here)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if match(args):
            found.append(int(cmdline.parent.name))
    return found


def scripts_of(root: Path) -> list[int]:
    """Pids of deploy scripts still running for `root`."""
    return processes(lambda args: b"dflash-deploy" in args and str(root).encode() in args)


def signal_all(pids: list[int], signum: int) -> list[int]:
    done = []
    for pid in pids:
        try:
            os.kill(pid, signum)
            done.append(pid)
        except ProcessLookupError:
            pass
    return done


@pytest.mark.slow  # ~30 s a trial on a loaded 2-core machine: four CLI runs and a 4 s watch
@pytest.mark.parametrize("trial", range(2))
def test_a_killed_deploy_never_ends_the_next_commands_job(remote: Where, trial: int) -> None:
    # restart waits for the lock while the killed deploy's script is frozen (10 s at most) and
    # then finishes (what is left of the 3 s stop wait, the start): on a loaded machine that
    # took more than the 5 s a 15 s wait leaves
    remote.config(STUBBORN, extra="lock_wait = 30\n")
    assert remote.run("deploy", *remote.flags).returncode == 0
    wait_for(lambda: log_has(remote, "up"), "the first job start")

    env = dict(os.environ, PYTHONPATH=str(REPO))
    deploy = subprocess.Popen(
        [sys.executable, "-m", "dflash_ops", "deploy", *remote.flags], cwd=remote.project,
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    wait_for(lambda: log_has(remote, "got-int"), "the stop step's SIGINT")
    time.sleep(0.3 * trial)  # somewhere inside the 3 s the stop step waits
    deploy.send_signal(signal.SIGKILL)
    deploy.wait()
    # Whatever is left of its script is held still while `restart` runs (a busy machine can
    # make it that slow), then let go: nothing it does after that may touch the new job.
    frozen = signal_all(scripts_of(remote.root), signal.SIGSTOP)
    restart = subprocess.Popen(
        [sys.executable, "-m", "dflash_ops", "restart", *remote.flags], cwd=remote.project,
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    end = time.monotonic() + 10  # until the new job is up (or restart waits for the lock)
    while log_text(remote).count("\nup\n") < 2 and restart.poll() is None:
        if time.monotonic() > end:
            break
        time.sleep(0.05)
    signal_all(frozen, signal.SIGCONT)
    _, err = restart.communicate(timeout=60)
    assert restart.returncode == 0, err
    started = remote.status(*remote.flags)
    assert started["running"]
    time.sleep(4.0)  # longer than what was left of the killed command's stop step
    after = remote.status(*remote.flags)
    assert after["running"] and after["started_at"] == started["started_at"], after
    wait_for(lambda: not scripts_of(remote.root), "the killed deploy's script end", 5.0)
    assert not (remote.root / LOCK_NAME).is_symlink()
    assert remote.run("stop", *remote.flags).returncode == 0


@pytest.fixture
def ssh_target(tmp_path: Path, ssh_home: object) -> Iterator[Where]:
    project = tmp_path / "project"
    project.mkdir()
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    where = Where("ssh", project, ["--target", "box"], root, ckpt, f"dft-{uuid.uuid4().hex[:10]}")
    where.targets = (
        f'[targets.box]\nplace = "ssh"\nhost = "testbox"\nroot = "{root}"\ncheckpoints = "{ckpt}"\n'
    )
    where.config("echo up; exec sleep 600", extra="lock_wait = 0.5\n")
    yield where
    kill_tmux_server(where.socket)


def identity(pid: int) -> str:
    """ "BOOT_ID START_TICKS" of a process, as the place records its lock holder."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    stat = Path(f"/proc/{pid}/stat").read_text()
    return f"{boot} {stat.rsplit(') ', 1)[1].split()[19]}"


def lock_record(pid: int, start: str) -> str:
    record = {"by": "ann@" + socket.gethostname(), "host": socket.gethostname(), "pid": pid,
              "since": time.time(), "doing": "deploy", "token": "feedbeef",
              "place_pid": pid, "place_start": start}  # fmt: skip
    return json.dumps(record, separators=(",", ":"), sort_keys=True)


def test_a_reused_pid_does_not_hold_the_lock(ssh_target: Where) -> None:
    where = ssh_target
    assert where.run("deploy", *where.flags).returncode == 0
    other = subprocess.Popen(["sleep", "60"])  # a live process that is not the holder
    try:
        lock = where.root / LOCK_NAME
        # The record names `other`'s pid both as the CLI (this host) and as the script, with
        # another start time: the script that held it is gone, its pid reused.
        lock.symlink_to(lock_record(other.pid, identity(other.pid).split()[0] + " 1"))
        taken = where.run("restart", *where.flags)
        assert taken.returncode == 0, taken.stderr
        assert "Taking over the deploy lock" in taken.stderr
        assert f"its script (pid {other.pid} at the place) has ended" in taken.stderr
        assert not lock.is_symlink() and where.status(*where.flags)["running"]

        # The same pid with its real start time: the holder lives, the lock is refused.
        live = lock_record(other.pid, identity(other.pid))
        lock.symlink_to(live)
        held = where.run("restart", *where.flags)
        assert held.returncode == 1 and "Traceback" not in held.stderr
        assert f"(pid {other.pid}, its script pid {other.pid} at the place)" in held.stderr
        assert "deploy by ann@" in held.stderr and "--force" in held.stderr
        assert os.readlink(lock) == live
    finally:
        other.kill()
        other.wait()
    assert where.run("stop", *where.flags).returncode == 0  # the holder is gone now


def test_status_names_the_release_the_job_still_runs(ssh_target: Where) -> None:
    """After a switch without the restart (a deploy dropped between its switch and stop
    steps), `status` says which release is current and which one the job runs."""
    where = ssh_target
    assert where.run("deploy", *where.flags).returncode == 0
    (running,) = where.releases()
    newer = "20991231-000000-000-ffff"
    (where.root / "releases" / newer).mkdir()
    (where.root / "releases" / newer / ".complete").touch()
    point_current(where, newer)
    report = where.status(*where.flags)
    assert (report["release"], report["job_release"]) == (newer, running)
    human = where.run("status", *where.flags)
    assert f"release {newer} is current, the job still runs release {running}" in human.stderr
    assert "dflash restart" in human.stderr
    point_current(where, running)
    assert "still runs" not in where.run("status", *where.flags).stderr
    assert where.run("stop", *where.flags).returncode == 0


def point_current(where: Where, release: str) -> None:
    (where.root / "current.new").symlink_to(f"releases/{release}")
    (where.root / "current.new").replace(where.root / "current")


@pytest.mark.parametrize("kind", ["local", "ssh"])
def test_held_open_stdin_ends_only_with_the_command(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """`HeldOpen(data)`: the command reads the data, then no end of input while it runs (a
    `read` times out instead of meeting EOF); plain bytes end with EOF as before."""
    from dflash_ops.connect.transport import HeldOpen, LocalTransport, SSHTransport

    if kind == "ssh":
        request.getfixturevalue("ssh_home")
    transport = LocalTransport() if kind == "local" else SSHTransport("testbox")
    script = 'head -c 3; read -r -t 0.5 x; echo " rc=$?"'
    try:
        held = transport.run(["bash", "-c", script], stdin=HeldOpen(b"abc"), timeout=30)
        plain = transport.run(["bash", "-c", script], stdin=b"abc", timeout=30)
    finally:
        transport.close()
    assert held.stdout == b"abc rc=142\n"  # 128 + SIGALRM: timed out, the input still open
    assert plain.stdout == b"abc rc=1\n"  # EOF
