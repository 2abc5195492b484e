"""The keepalive (`dflash_ops/connect/keepalive.py`) against a real sshd on loopback.

A peer that stops answering is made by holding its sshd processes with SIGSTOP: the kernel
still acknowledges every TCP segment, only SSH goes silent, so nothing but the keepalive can
notice. It is declared dead within ServerAliveInterval × (ServerAliveCountMax + 1) seconds (the
settings from ssh_config) and the command in flight raises `ConnectionDropped`; a quiet command,
or an upload its command does not read yet, on a live peer is never dropped (sshd answers the
probes itself). ServerAliveInterval/ServerAliveCountMax resolve as `ssh -G` resolves them, with
and without the ssh client.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_ops.connect.keepalive import DEFAULT_INTERVAL, AliveSettings
from dflash_ops.connect.ssh_config import resolve
from dflash_ops.connect.transport import SSHTransport
from dflash_ops.errors import ConnectionDropped, DflashError
from tests.fixtures.ssh import SSHHome, SSHServer, new_server, shutdown, write_client_home
from tests.system.test_remote_faults import signal_all

SLACK = 4.0  # a loaded 2-core machine: scheduling of the watchdog and the test's threads


@pytest.fixture
def own_sshd(tmp_path: Path) -> Iterator[SSHServer]:
    """A server of this test alone: every sshd process below it serves this test."""
    server = new_server(tmp_path / "sshd")
    yield server
    shutdown(server)


def alive_home(
    server: SSHServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: str
) -> SSHHome:
    home = write_client_home(server, tmp_path / "home", options=options)
    monkeypatch.setenv("HOME", str(home.home))
    return home


def sshd_processes(server: SSHServer) -> list[int]:
    """The per-connection sshd processes below the listener (not the commands they run)."""
    assert server._proc is not None
    found, todo = [], [server._proc.pid]
    while todo:
        parent = todo.pop()
        for entry in Path("/proc").glob("[0-9]*/stat"):
            try:
                stat = entry.read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                pid = int(entry.parent.name)
                todo.append(pid)
                if stat.split("(", 1)[1].startswith("sshd"):
                    found.append(pid)
    return found


def test_a_silent_peer_is_declared_dead_within_the_bound(
    own_sshd: SSHServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alive_home(own_sshd, tmp_path, monkeypatch, "ServerAliveInterval 1\nServerAliveCountMax 2")
    transport = SSHTransport("testbox")
    ended: dict[str, object] = {}

    def command() -> None:
        try:
            transport.run(["sleep", "60"])
        except DflashError as exc:
            ended["error"] = exc
        ended["at"] = time.monotonic()

    runner = threading.Thread(target=command, daemon=True)
    runner.start()
    time.sleep(1.5)  # the command runs; a probe or two were answered
    held = sshd_processes(own_sshd)
    assert held
    signal_all(held, signal.SIGSTOP)
    silent = time.monotonic()
    try:
        runner.join(timeout=3.0 + SLACK + 20)
    finally:
        signal_all(held, signal.SIGCONT)
    assert not runner.is_alive(), "the command still waits on a silent peer"
    error = ended.get("error")
    assert isinstance(error, ConnectionDropped), error
    took = float(ended["at"]) - silent  # type: ignore[arg-type]
    # From the last byte (at most one interval before the silence): 3 s, two probes unanswered.
    assert 2.0 - 0.2 <= took <= 3.0 + SLACK, took
    assert "no answer from root@127.0.0.1" in str(error), error
    assert "2 keepalive probes unanswered" in str(error), error
    assert "ServerAliveInterval 1 s, ServerAliveCountMax 2" in str(error), error
    transport.reconnect()  # the peer answers again: a new connection works
    assert transport.run(["echo", "back"]).stdout == b"back\n"
    transport.close()


def test_a_quiet_command_on_a_live_peer_is_never_dropped(
    own_sshd: SSHServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Longer than the bound without a byte of output, and a 4 MiB upload the command reads
    only after a while: sshd answers the probes, so both finish."""
    alive_home(own_sshd, tmp_path, monkeypatch, "ServerAliveInterval 1\nServerAliveCountMax 1")
    transport = SSHTransport("testbox")
    assert transport.run(["sh", "-c", "sleep 4; echo done"]).stdout == b"done\n"
    data = os.urandom(4 << 20)
    read = transport.run(["sh", "-c", "sleep 4; wc -c"], stdin=data)
    assert read.stdout.strip() == str(len(data)).encode()
    assert transport.connections_opened == 1
    transport.close()


def test_the_settings_come_from_ssh_config(ssh_home: SSHHome) -> None:
    text = ssh_home.config.read_text()
    ssh_home.config.write_text(
        "Host quick\n    ServerAliveInterval 2\n    ServerAliveCountMax 1\n"
        "Host slow\n    ServerAliveInterval 1m30s\n"
        "Host off\n    ServerAliveInterval 0\n    ServerAliveCountMax 0\n" + text
    )
    assert resolve("quick").alive == AliveSettings(2.0, 1)
    assert resolve("slow").alive == AliveSettings(90.0, 3)
    assert resolve("off").alive == AliveSettings(DEFAULT_INTERVAL, 0)  # 0 is "off" in ssh
    assert resolve(ssh_home.alias).alive == AliveSettings(DEFAULT_INTERVAL, 3)
    assert resolve("quick").alive.bound == 4.0
