"""`dflash logs --follow` under faults: the SSH server restarted while following (no line lost
or repeated), and Ctrl-C (the follower detaches, the job keeps running)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_helpers import REPO, Where, container_defaults, default_sigint, kill_tmux_server


def start_follow(where: Where) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_ops", "logs", "--follow", "--tail", "1000"],
        cwd=where.project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )


def wait_for_lines(log: Path, count: int, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if log.exists() and log.read_text().count("\n") >= count:
            return
        time.sleep(0.1)
    raise AssertionError(f"fewer than {count} lines in {log}")


@pytest.fixture(params=["ssh", "proxmox"])
def remote_where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Where]:
    project = tmp_path / "project"
    project.mkdir()
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    if request.param == "ssh":
        request.getfixturevalue("ssh_home")
        root, ckpt = tmp_path / "root", tmp_path / "ckpt"
        spot = Where("ssh", project, ["--target", "box"], root, ckpt, socket)
        spot.targets = (
            f'[targets.box]\nplace = "ssh"\nhost = "testbox"\n'
            f'root = "{root}"\ncheckpoints = "{ckpt}"\n'
        )
        yield spot
        kill_tmux_server(socket)
    else:
        proxmox = request.getfixturevalue("proxmox")
        proxmox.create(200)
        yield Where(
            "proxmox",
            project,
            ["--host", proxmox.alias, "--ct", "200"],
            *container_defaults(proxmox, 200, project),
            socket,
        )


def test_follow_survives_sshd_restart(remote_where: Where, sshd) -> None:  # type: ignore[no-untyped-def]
    where = remote_where
    where.config("for i in $(seq 1 60); do echo line $i; sleep 0.1; done; exit 4")
    assert where.run("deploy", *where.flags).returncode == 0
    log = where.checkpoints / "train_stdout.log"
    follower = start_follow(where)
    try:
        assert follower.stdout is not None
        first = [follower.stdout.readline() for _ in range(10)]  # connected and streaming
        sshd.stop()  # every connection drops, the job (in tmux) goes on
        time.sleep(1.0)
        sshd.start()
        watchdog = threading.Timer(90, follower.kill)
        watchdog.start()
        out = follower.stdout.read()  # the same buffered reader as readline above
        err = follower.stderr.read() if follower.stderr else ""
        follower.wait()
        watchdog.cancel()
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 4, err
    expected = "".join(f"line {i}\n" for i in range(1, 61))
    assert "".join(first) + out == expected  # nothing lost, nothing repeated
    assert log.read_text() == expected


def test_ctrl_c_detaches_and_the_job_keeps_running(tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    root = project / ".dflash" / "local"
    where = Where("local", project, [], root, root / "checkpoints", f"dft-{uuid.uuid4().hex[:10]}")
    where.config("echo started; sleep 60")
    try:
        assert where.run("deploy").returncode == 0
        follower = start_follow(where)
        assert follower.stdout is not None
        assert follower.stdout.readline() == "started\n"  # the follower is streaming
        follower.send_signal(signal.SIGINT)
        out, err = follower.communicate(timeout=30)
        assert follower.returncode == 130, err
        assert "job keeps running" in err and "Traceback" not in err
        assert where.status()["running"]
    finally:
        kill_tmux_server(where.socket)


def _tgkill(pid: int, tid: int, sig: int) -> None:
    """Send `sig` to thread `tid` of process `pid` (tgkill(2): no Python wrapper)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sys_tgkill = 234 if os.uname().machine == "x86_64" else 131  # aarch64: 131
    if libc.syscall(sys_tgkill, pid, tid, sig) != 0:
        raise OSError(ctypes.get_errno(), "tgkill")


@pytest.mark.parametrize("kind", ["local", "ssh"])
def test_ctrl_c_taken_by_another_thread_still_detaches(
    request: pytest.FixtureRequest, tmp_path: Path, kind: str
) -> None:
    """The terminal's SIGINT goes to one thread of the follower, not always the main one; on a
    quiet log the main thread waits for bytes that do not come, and must still see it."""
    project = tmp_path / "project"
    project.mkdir()
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    if kind == "local":
        root = project / ".dflash" / "local"
        where = Where("local", project, [], root, root / "checkpoints", socket)
    else:
        request.getfixturevalue("ssh_home")  # HOME with the `testbox` alias
        where = Where(
            "ssh", project, ["--target", "box"], tmp_path / "root", tmp_path / "c", socket
        )
        where.targets = (
            f'[targets.box]\nplace = "ssh"\nhost = "testbox"\n'
            f'root = "{where.root}"\ncheckpoints = "{where.checkpoints}"\n'
        )
    where.config("echo started; exec sleep 600")  # then silent
    try:
        assert where.run("deploy", *where.flags).returncode == 0
        follower = start_follow(where) if kind == "local" else None
        if follower is None:
            env = dict(os.environ, PYTHONPATH=str(REPO))
            follower = subprocess.Popen(
                [sys.executable, "-m", "dflash_ops", "logs", "--follow", *where.flags],
                cwd=where.project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True, preexec_fn=default_sigint,
            )  # fmt: skip
        assert follower.stdout is not None
        assert follower.stdout.readline() == "started\n"  # streaming, now waiting
        time.sleep(0.5)
        others = [
            int(t) for t in os.listdir(f"/proc/{follower.pid}/task") if int(t) != follower.pid
        ]
        assert others, "the follower reads stderr in a thread of its own"
        _tgkill(follower.pid, others[0], signal.SIGINT)
        out, err = follower.communicate(timeout=20)
        assert follower.returncode == 130, err
        assert "job keeps running" in err and "Traceback" not in err
        assert where.status(*where.flags)["running"]
    finally:
        kill_tmux_server(socket)
