"""Connection failures say what happened, in one `error:` line and a hint, and nothing else.

Loopback TCP servers started here stand in for what goes wrong at a real port: a service that
is not SSH, a server that closes before saying anything, and a relay in front of the real sshd
that resets the connection right after the key exchange (sshd killed mid-handshake) or goes
silent there (a link cut mid-handshake). A dropped
connection is reported as dropped, never as a key problem, and never with an empty reason.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dflash_ops.connect.transport import SSHTransport
from dflash_ops.errors import (
    AuthenticationFailed,
    ConnectionDropped,
    ConnectionFailed,
    NotAnSSHServer,
)
from tests.cli_helpers import dflash
from tests.fixtures.ssh import SSHHome, SSHServer

Handler = Callable[[socket.socket], None]


@contextlib.contextmanager
def serve(handler: Handler) -> Iterator[int]:
    """A loopback server that runs `handler` on every accepted connection; yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_run, args=(handler, conn), daemon=True).start()

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join()
        listener.close()


def _run(handler: Handler, conn: socket.socket) -> None:
    with contextlib.suppress(OSError), conn:
        handler(conn)


def _reset(conn: socket.socket) -> None:
    """Close with a TCP reset, as a killed process's socket does."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def speaks_http(conn: socket.socket) -> None:
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


def speaks_http_then_resets(conn: socket.socket) -> None:
    """An HTTP server that answers, then drops the connection with the client's SSH banner
    unread (the kernel then resets it): what a busy web server on the port can do."""
    speaks_http(conn)
    time.sleep(0.5)  # the client has read the answer by now
    _reset(conn)


def closes_at_once(conn: socket.socket) -> None:
    _reset(conn)


def stays_silent(conn: socket.socket) -> None:
    """Takes the connection and says nothing, as a hung sshd or a holding firewall does."""
    time.sleep(8)


def relay_after_kex(sshd_port: int, *, cut: bool = True) -> Handler:
    """Forward to the real sshd until the server's NEWKEYS; then, at the client's next packet
    (it is asking to authenticate), reset both sides (`cut`: sshd killed mid-handshake), or
    drop what the client sends, the connection left open (a link cut silently)."""

    def handler(client: socket.socket) -> None:
        server = socket.create_connection(("127.0.0.1", sshd_port))
        seen, newkeys = b"", False
        while True:
            ready, _, _ = select.select([client, server], [], [], 30)
            if not ready:
                return
            if client in ready:
                data = client.recv(65536)
                if not data or (newkeys and cut):
                    break
                if not newkeys:
                    server.sendall(data)
            if server in ready:
                data = server.recv(65536)
                if not data:
                    break
                seen += data
                newkeys = newkeys or _has_newkeys(seen)
                client.sendall(data)
        _reset(server)
        _reset(client)

    return handler


def _has_newkeys(stream: bytes) -> bool:
    """Whether the server's cleartext packets (after its banner line) include NEWKEYS (21)."""
    _, sep, rest = stream.partition(b"\r\n")
    while sep and len(rest) >= 6:
        (length,) = struct.unpack(">I", rest[:4])
        if rest[5] == 21:
            return True
        rest = rest[4 + length :]
    return False


def _trust(home: SSHHome, port: int) -> None:
    """The relay's port presents the fixture server's key: known_hosts says so."""
    with home.known_hosts.open("a") as handle:
        handle.write(f"[127.0.0.1]:{port} {home.server.host_public_key}\n")


def _connect(port: int) -> None:
    SSHTransport("127.0.0.1", port=port).connect()


@pytest.mark.parametrize("server", [speaks_http, speaks_http_then_resets])
def test_a_port_that_is_not_ssh(ssh_home: SSHHome, server: Handler) -> None:
    with serve(server) as port, pytest.raises(NotAnSSHServer) as info:
        _connect(port)
    assert f"127.0.0.1:{port} answered, but not as an SSH server" in str(info.value)
    assert "port" in info.value.hint


def test_a_server_that_closes_before_its_banner(ssh_home: SSHHome) -> None:
    with serve(closes_at_once) as port, pytest.raises(ConnectionDropped) as info:
        _connect(port)
    assert "closed the connection before saying anything" in str(info.value)
    assert str(info.value).rstrip().endswith(")") and "()" not in str(info.value)


def test_a_port_that_never_answers_is_said_to_be_silent(ssh_home: SSHHome) -> None:
    """Not "closed the connection": it was open all along; the hint keeps the port and user."""
    with ssh_home.config.open("a") as handle:
        handle.write("Host silentbox\n    HostName 127.0.0.1\n    User ann\n    ConnectTimeout 2\n")
    with serve(stays_silent) as port, pytest.raises(ConnectionFailed) as info:
        SSHTransport("silentbox", port=port).connect()
    text = str(info.value)
    assert not isinstance(info.value, ConnectionDropped) and "closed" not in text
    assert f"127.0.0.1:{port} accepted the connection but did not answer" in text
    assert "no SSH banner within 2 s" in text
    config = ssh_home.config  # ssh would read the account's own ~/.ssh: HOME is another here
    assert f"ssh -v -F {config} -p {port} ann@silentbox true" in info.value.hint


def test_hints_name_the_port_and_user_to_try_by_hand(ssh_home: SSHHome) -> None:
    with serve(closes_at_once) as port, pytest.raises(ConnectionDropped) as info:
        SSHTransport("127.0.0.1", port=port, user="ann").connect()
    assert f"(ssh -v -F {ssh_home.config} -p {port} ann@127.0.0.1 true)" in info.value.hint
    with socket.socket() as unused:  # a port nothing listens on
        unused.bind(("127.0.0.1", 0))
        free = unused.getsockname()[1]
    with pytest.raises(ConnectionFailed) as refused:
        SSHTransport("127.0.0.1", port=free, user="ann").connect()
    assert "Connection refused" in str(refused.value)
    assert refused.value.hint.endswith(f"ssh -F {ssh_home.config} -p {free} ann@127.0.0.1 true")


def test_a_drop_after_key_exchange_is_a_drop_not_a_key_problem(
    ssh_home: SSHHome, sshd: SSHServer
) -> None:
    with serve(relay_after_kex(sshd.port)) as port:
        _trust(ssh_home, port)
        for _ in range(3):
            transport = SSHTransport("testbox", port=port)
            with pytest.raises(ConnectionDropped) as info:
                transport.connect()
            assert not isinstance(info.value, AuthenticationFailed)
            assert "during the SSH handshake" in str(info.value)
            assert not str(info.value).endswith(": ") and "()" not in str(info.value)


def test_a_silence_after_key_exchange_is_a_drop_not_a_key_problem(
    ssh_home: SSHHome, sshd: SSHServer
) -> None:
    with ssh_home.config.open("a") as handle:
        handle.write("Host testbox\n    ConnectTimeout 2\n")
    with serve(relay_after_kex(sshd.port, cut=False)) as port:
        _trust(ssh_home, port)
        began = time.monotonic()
        with pytest.raises(ConnectionDropped) as info:
            SSHTransport("testbox", port=port).connect()
    assert time.monotonic() - began < 2 + 10  # ConnectTimeout, and a loaded machine
    assert not isinstance(info.value, AuthenticationFailed)
    assert "stopped answering during the SSH handshake" in str(info.value)
    assert "ConnectTimeout, 2 s" in str(info.value)


def test_too_many_keys_is_an_authentication_failure_not_a_drop(
    ssh_home: SSHHome, sshd: SSHServer, tmp_path: Path
) -> None:
    """sshd disconnects after MaxAuthTries (6) refused keys: that is about keys, and says so."""
    strangers = []
    for number in range(7):
        key = tmp_path / f"stranger{number}"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        strangers.append(key)
    with pytest.raises(AuthenticationFailed) as info:
        SSHTransport("testbox", identity_files=strangers).connect()
    assert "Too many authentication failures" in str(info.value)


def _project(tmp_path: Path) -> Path:
    project = tmp_path / "project"
    project.mkdir()
    (project / "deploy.toml").write_text('[job]\ncommand = "true"\n[train]\ndemo = true\n')
    return project


def test_cli_prints_one_error_and_a_hint_only(
    ssh_home: SSHHome, sshd: SSHServer, tmp_path: Path
) -> None:
    project = _project(tmp_path)
    handlers = [
        (speaks_http, "127.0.0.1", "not as an SSH server"),
        (closes_at_once, "127.0.0.1", "before saying anything"),
        (relay_after_kex(sshd.port), "testbox", "during the SSH handshake"),
    ]
    for handler, host, words in handlers:
        with serve(handler) as port:
            _trust(ssh_home, port)
            result = dflash(project, "status", "--host", host, "--port", str(port), timeout=60)
        lines = result.stderr.splitlines()
        assert result.returncode == 1, result.stderr
        assert len(lines) == 2, result.stderr  # no "Socket exception", no traceback
        assert lines[0].startswith("error:") and words in lines[0]
        assert lines[1].startswith("hint:")
    with serve(speaks_http) as port:  # paramiko's own lines come back with --verbose
        verbose = dflash(project, "--verbose", "status", "--host", "127.0.0.1", "--port", str(port))
    assert verbose.returncode == 1 and "paramiko.transport" in verbose.stderr
