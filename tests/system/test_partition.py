"""A silent network partition: the link to the place is cut in the middle of a command (packets
dropped, no reset), with real parts: sshd in a network namespace behind a veth pair the test
cuts (`tests/fixtures/netns.py`), the `pct` stand-in, real tmux.

- `deploy` and `stop`, cut while the place's program waits for the job to stop (a silent step
  longer than the keepalive's bound), end within the bound with `ConnectionDropped` saying what
  the place may be left with; once the link is back the program there ends itself, and the
  next deploy leaves exactly one job.
- `logs --follow` keeps reconnecting through a cut and loses no line.

The ssh_config of the test's HOME sets ServerAliveInterval 1 and ServerAliveCountMax 2 (a
3 s bound), which is also how these settings are shown to be read from ssh_config.

Rerun: .venv/bin/python -m pytest -q tests/system/test_partition.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_ops.remote.lock import LOCK_NAME
from tests.cli_helpers import REPO, Where, kill_tmux_server
from tests.fixtures.netns import Partition
from tests.fixtures.proxmox import Proxmox
from tests.system.test_remote_faults import STUBBORN, log_has, processes, wait_for

CT = 247
SLACK = 12.0  # a loaded 2-core machine: Python start-up, the CLI's error path, scheduling


class CutPlace:
    """A `Where` reached through the partition: the CLI runs inside its client namespace."""

    def __init__(self, where: Where, partition: Partition, token: str) -> None:
        self.where = where
        self.partition = partition
        self.token = token  # in the job's command line: its processes are this test's

    def argv(self, *args: str) -> list[str]:
        return self.partition.client([sys.executable, "-m", "dflash_ops", *args])

    def popen(self, *args: str) -> subprocess.Popen[str]:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        return subprocess.Popen(
            self.argv(*args, *self.where.flags), cwd=self.where.project, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def run(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        proc = self.popen(*args)
        out, err = proc.communicate(timeout=timeout)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)

    def mine(self, args: list[bytes]) -> bool:
        return any(self.token.encode() in arg for arg in args)

    def jobs(self) -> list[int]:
        """Pids of this test's jobs (`bash -c COMMAND dflash-command`): a job's bash forks a
        child for each `sleep`, which has its parent's argv until it runs `sleep`, so only the
        matches whose parent is not one count."""
        found = processes(lambda args: b"dflash-command" in args and self.mine(args))
        return [pid for pid in found if _parent(pid) not in found]

    def scripts(self) -> list[int]:
        """Pids of the place's programs (`site.sh`) still running for this target."""
        names = (b"dflash-deploy", b"dflash-stop")
        return processes(lambda args: any(n in args for n in names) and self.mine(args))


def _parent(pid: int) -> int | None:
    """The parent of `pid` (None once it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


@pytest.fixture(params=["ssh", "proxmox"])
def cut_place(
    request: pytest.FixtureRequest, tmp_path: Path, partition: Partition
) -> Iterator[CutPlace]:
    project = tmp_path / "project"
    project.mkdir()
    sock, token = f"dft-{uuid.uuid4().hex[:10]}", f"cut-{uuid.uuid4().hex[:10]}"
    node = Proxmox(state=partition.server.pct_state, ssh=partition.home)
    if request.param == "ssh":
        root, ckpt = tmp_path / token / "root", tmp_path / token / "ckpt"
        where = Where("ssh", project, ["--target", "box"], root, ckpt, sock)
        where.targets = (
            f'[targets.box]\nplace = "ssh"\nhost = "testbox"\n'
            f'root = "{root}"\ncheckpoints = "{ckpt}"\n'
        )
    else:
        node.create(CT)
        # the container's own folders, named so that the place's programs carry the token
        where = Where(
            "proxmox", project, ["--target", "box"], node.root_dir(CT) / token,
            node.workspace_dir(CT) / "checkpoints", sock,
        )  # fmt: skip
        where.targets = (
            f'[targets.box]\nplace = "proxmox"\nhost = "{node.alias}"\nct = {CT}\n'
            f'root = "/root/{token}"\ncheckpoints = "/workspace/checkpoints"\n'
        )
    # STUBBORN ignores SIGINT: the stop step waits `stop_timeout` for it, printing nothing
    where.config(f"{STUBBORN} # {token}", stop_timeout=8, extra="lock_wait = 60\n")
    yield CutPlace(where, partition, token)
    if request.param == "ssh":
        kill_tmux_server(sock)
    node.teardown()


def cut_during_the_stop_step(place: CutPlace, command: str) -> tuple[float, str]:
    """Run `command` and cut the link once its stop step has sent SIGINT to the job; the
    seconds from the cut to the command's end, and what it printed."""
    proc = place.popen(command)
    try:
        wait_for(lambda: log_has(place.where, "got-int"), "the stop step's SIGINT", 90)
        place.partition.cut()
        cut = time.monotonic()
        try:
            _, err = proc.communicate(timeout=place.partition.bound + SLACK + 30)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
            return time.monotonic() - cut, err
        return time.monotonic() - cut, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # ~40 s on a loaded 2-core machine: three CLI runs, a cut, the place's end
@pytest.mark.parametrize("command", ["deploy", "stop"])
def test_a_cut_link_ends_the_command_in_bounded_time(cut_place: CutPlace, command: str) -> None:
    place = cut_place
    first = place.run("deploy")
    assert first.returncode == 0, first.stderr
    wait_for(lambda: log_has(place.where, "up"), "the job's start", 60)
    assert len(place.jobs()) == 1

    took, err = cut_during_the_stop_step(place, command)
    print(f"{command} over {place.where.kind}: error {took:.1f} s after the cut")
    assert took <= place.partition.bound + SLACK, (took, err)
    assert "Traceback" not in err, err
    assert "error: Lost the connection" in err and "no answer" in err, err
    assert "ServerAliveInterval 1 s, ServerAliveCountMax 2" in err, err
    assert f"during dflash {command}, at its 'stop' step" in err and "hint:" in err, err
    # From the stop on the place's program finishes the command by itself.
    assert "goes on by itself to the end" in err, err
    started = "switches `current` to the new release and starts it" in err
    assert started == (command == "deploy"), err

    place.partition.restore()
    # The place's program ends (having finished), releasing the lock.
    wait_for(lambda: not place.scripts(), "the place's program's end", 120)
    wait_for(lambda: not (place.where.root / LOCK_NAME).is_symlink(), "the lock's release", 10)
    assert len(place.jobs()) <= 1  # never a second job

    again = place.run("deploy")
    assert again.returncode == 0, again.stderr
    wait_for(lambda: len(place.jobs()) == 1, "exactly one job", 30)
    time.sleep(1.0)
    assert len(place.jobs()) == 1
    assert place.run("stop", "--no-save").returncode == 0
    assert not place.jobs()


def test_logs_follow_reconnects_through_a_cut(partition: Partition, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    sock, token = f"dft-{uuid.uuid4().hex[:10]}", f"cut-{uuid.uuid4().hex[:10]}"
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    where = Where("ssh", project, ["--target", "box"], root, ckpt, sock)
    where.targets = (
        f'[targets.box]\nplace = "ssh"\nhost = "testbox"\nroot = "{root}"\ncheckpoints = "{ckpt}"\n'
    )
    where.config(f"for i in $(seq 1 400); do echo line $i; sleep 0.1; done; exit 4 # {token}")
    place = CutPlace(where, partition, token)
    try:
        assert place.run("deploy").returncode == 0
        follower = place.popen("logs", "--follow", "--tail", "1000")
        assert follower.stdout is not None
        first = [follower.stdout.readline() for _ in range(10)]  # connected and streaming
        partition.cut()
        time.sleep(partition.bound + 4.0)  # the stream's connection is declared dead
        partition.restore()
        watchdog = threading.Timer(120, follower.kill)
        watchdog.start()
        out = follower.stdout.read()  # the buffered reader readline used (communicate skips it)
        err = follower.stderr.read() if follower.stderr else ""
        follower.wait()
        watchdog.cancel()
    finally:
        partition.restore()
        kill_tmux_server(sock)
    assert follower.returncode == 4, err
    assert "".join(first) + out == "".join(f"line {i}\n" for i in range(1, 401)), err
    assert "no answer from" in err and "reconnecting" in err, err
