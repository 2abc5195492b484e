"""transport.py and ssh_config.py against a local subprocess and a real sshd on loopback."""

from __future__ import annotations

import io
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

from dflash_ops.connect.ssh_config import resolve
from dflash_ops.connect.transport import STDERR_CAP, LocalTransport, SSHTransport, Transport
from dflash_ops.errors import (
    AuthenticationFailed,
    CommandTimedOut,
    ConnectionFailed,
    HostKeyChanged,
    HostKeyUnknown,
    UnsafeValue,
)
from tests.fixtures.ssh import SSHHome, SSHServer, free_port

BIG = 3 * 1024 * 1024  # bigger than any pipe buffer or SSH channel window
PRODUCE_BIG = f"head -c {BIG} /dev/zero | tr '\\0' o; head -c {BIG} /dev/zero | tr '\\0' e >&2"


@pytest.fixture(params=["local", "ssh"])
def transport(request: pytest.FixtureRequest) -> Transport:
    if request.param == "local":
        t: Transport = LocalTransport()
    else:
        request.getfixturevalue("ssh_home")
        t = SSHTransport("testbox")
    request.addfinalizer(t.close)
    return t


def accepted_logins(server: SSHServer) -> int:
    return server.log_path.read_text().count("Accepted publickey for root")


def test_exit_code_stdout_stderr(transport: Transport) -> None:
    result = transport.run(["sh", "-c", "echo out; echo err >&2; exit 7"])
    assert (result.exit_code, result.stdout, result.stderr) == (7, b"out\n", b"err\n")
    assert result.argv == ("sh", "-c", "echo out; echo err >&2; exit 7")
    assert transport.run(["true"]).ok


def test_missing_program_exits_127(transport: Transport) -> None:
    result = transport.run(["dflash-no-such-program", "x"])
    assert result.exit_code == 127
    assert b"dflash-no-such-program" in result.stderr


def test_stdin_bytes_and_file(transport: Transport, tmp_path: Path) -> None:
    data = os.urandom(BIG + 12345)
    assert transport.run(["cat"], stdin=data).stdout == data
    path = tmp_path / "blob"
    path.write_bytes(data)
    with path.open("rb") as handle:
        result = transport.run(["sha256sum"], stdin=handle)
    expected = subprocess.run(["sha256sum"], input=data, capture_output=True).stdout
    assert result.stdout == expected
    # A command that exits without reading its input must not hang us.
    assert transport.run(["true"], stdin=io.BytesIO(data)).exit_code == 0


def test_big_stdout_and_stderr_together(transport: Transport) -> None:
    """Both streams are read to their end at once (neither blocks the other); what is kept is
    bounded: stdout's first `cap` bytes, stderr's last `STDERR_CAP`, the rest counted."""
    result = transport.run(["sh", "-c", PRODUCE_BIG])
    assert result.exit_code == 0
    assert result.stdout == b"o" * BIG and result.stdout_more == 0
    assert result.stderr == b"e" * STDERR_CAP and result.stderr_more == BIG - STDERR_CAP
    assert result.stderr_text.startswith(f"… {BIG - STDERR_CAP:,} bytes more before this:\n")
    capped = transport.run(["sh", "-c", PRODUCE_BIG + "; echo last >&2"], cap=1000)
    assert capped.stdout == b"o" * 1000 and capped.stdout_more == BIG - 1000
    assert capped.stderr.endswith(b"elast\n") and len(capped.stderr) == STDERR_CAP


def test_stream_yields_chunks_then_exit_code(transport: Transport) -> None:
    stream = transport.stream(["sh", "-c", "echo one; sleep 0.3; echo two; echo bad >&2; exit 5"])
    assert stream.exit_code is None
    first = next(stream)
    assert first == b"one\n"  # arrived before the command finished
    assert stream.exit_code is None
    rest = b"".join(stream)
    assert rest == b"two\n"
    assert stream.exit_code == 5
    assert stream.stderr == b"bad\n"


def test_stream_close_ends_command(transport: Transport) -> None:
    stream = transport.stream(["sh", "-c", "echo start; sleep 30"])
    assert next(stream) == b"start\n"
    stream.close()
    assert list(stream) == []


def test_timeout(transport: Transport) -> None:
    with pytest.raises(CommandTimedOut, match="sleep"):
        transport.run(["sleep", "20"], timeout=0.5)


def test_argv_checked_before_anything_runs(transport: Transport) -> None:
    with pytest.raises(UnsafeValue, match="NUL"):
        transport.run(["echo", "a\x00b"])


def test_one_connection_for_many_commands(ssh_home: SSHHome, sshd: SSHServer) -> None:
    before = accepted_logins(sshd)
    t = SSHTransport("testbox")
    assert t.connections_opened == 0  # lazy: nothing opened before the first command
    for i in range(20):
        assert t.run(["echo", str(i)]).stdout == f"{i}\n".encode()
    assert b"".join(t.stream(["echo", "streamed"])) == b"streamed\n"
    assert t.connections_opened == 1
    time.sleep(0.2)
    assert accepted_logins(sshd) - before == 1  # the server agrees
    t.close()


def test_ssh_config_resolution(ssh_home: SSHHome, sshd: SSHServer) -> None:
    target = resolve("testbox")
    assert (target.hostname, target.port, target.user) == ("127.0.0.1", sshd.port, "root")
    assert target.identity_files == (sshd.client_key,)
    assert target.known_hosts_files == (ssh_home.known_hosts,)
    assert target.identities_only
    # Explicit values win over the config; unknown names fall back to the defaults.
    assert resolve("testbox", port=2222, user="alice").port == 2222
    assert resolve("testbox", user="alice").user == "alice"
    assert resolve("alice@testbox").user == "alice"
    assert resolve("alice@testbox", user="bob").user == "bob"
    plain = resolve("10.9.9.9")
    assert (plain.hostname, plain.port, plain.user) == ("10.9.9.9", 22, "root")
    ssh_dir = ssh_home.home / ".ssh"
    assert plain.known_hosts_files == (ssh_dir / "known_hosts", ssh_dir / "known_hosts2")
    jumped = resolve("viajump")
    assert jumped.proxy_jump is not None and jumped.proxy_jump.port == sshd.port
    chain = resolve("x", proxy_jump="testbox,u@10.0.0.5:2200")
    assert chain.proxy_jump is not None
    assert (chain.proxy_jump.hostname, chain.proxy_jump.port, chain.proxy_jump.user) == (
        "10.0.0.5",
        2200,
        "u",
    )
    assert chain.proxy_jump.proxy_jump is not None
    assert chain.proxy_jump.proxy_jump.port == sshd.port


def test_connection_refused_names_host_and_port(ssh_home: SSHHome) -> None:
    port = free_port()
    t = SSHTransport("127.0.0.1", port=port)
    with pytest.raises(ConnectionFailed) as info:
        t.run(["true"])
    assert f"127.0.0.1:{port}" in str(info.value)
    assert not isinstance(info.value, HostKeyUnknown | AuthenticationFailed)


def test_unknown_host_key_refused_with_fingerprint(ssh_home: SSHHome, sshd: SSHServer) -> None:
    with pytest.raises(HostKeyUnknown) as info:
        SSHTransport("unknownbox").run(["true"])
    message = str(info.value)
    assert sshd.host_key_fingerprint in message  # as `ssh-keygen -l` prints it
    assert "ssh-ed25519" in message
    assert "--accept-new-host-key" in info.value.hint
    assert ssh_home.empty_known_hosts.read_text() == ""  # nothing was added silently


def test_accept_new_host_key_adds_it(ssh_home: SSHHome, sshd: SSHServer) -> None:
    t = SSHTransport("unknownbox", accept_new_host_key=True)
    assert t.run(["echo", "ok"]).stdout == b"ok\n"
    t.close()
    assert ssh_home.empty_known_hosts.read_text() == (
        f"[127.0.0.1]:{sshd.port} {sshd.host_public_key}\n"
    )
    # From now on the key is known: no flag needed.
    assert SSHTransport("unknownbox").run(["true"]).ok


def test_changed_host_key_refused_even_with_flag(
    ssh_home: SSHHome, sshd: SSHServer, tmp_path: Path
) -> None:
    other = tmp_path / "other_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)], check=True)
    fake = " ".join(Path(f"{other}.pub").read_text().split()[:2])
    ssh_home.known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {fake}\n")
    for accept in (False, True):
        with pytest.raises(HostKeyChanged) as info:
            SSHTransport("testbox", accept_new_host_key=accept).run(["true"])
        assert sshd.host_key_fingerprint in str(info.value)
        assert "ssh-keygen -R" in info.value.hint
    assert ssh_home.known_hosts.read_text() == f"[127.0.0.1]:{sshd.port} {fake}\n"


def test_wrong_key_is_authentication_failure(ssh_home: SSHHome, tmp_path: Path) -> None:
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)], check=True)
    with pytest.raises(AuthenticationFailed) as info:
        SSHTransport("testbox", identity_files=[stranger]).run(["true"])
    assert "root@127.0.0.1" in str(info.value)
    assert stranger.read_text().splitlines()[1] not in str(info.value)


def test_proxyjump_through_the_same_server(ssh_home: SSHHome, sshd: SSHServer) -> None:
    before = accepted_logins(sshd)
    t = SSHTransport("viajump")
    assert t.run(["echo", "through"]).stdout == b"through\n"
    assert t.run(["echo", "again"]).stdout == b"again\n"
    t.close()
    time.sleep(0.2)
    assert accepted_logins(sshd) - before == 2  # the jump host, then the target through it


def test_two_hop_proxyjump_chain(ssh_home: SSHHome, sshd: SSHServer) -> None:
    before = accepted_logins(sshd)
    t = SSHTransport("testbox", proxy_jump="testbox,pvehost")
    assert t.run(["echo", "far"]).stdout == b"far\n"
    t.close()
    time.sleep(0.2)
    assert accepted_logins(sshd) - before == 3


def test_no_key_at_all_is_authentication_failure(ssh_home: SSHHome, sshd: SSHServer) -> None:
    with pytest.raises(AuthenticationFailed, match="no key to offer"):
        SSHTransport("root@127.0.0.1", port=sshd.port).run(["true"])


def test_passphrase_key_without_agent(ssh_home: SSHHome, tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    secret = "s3cret-passphrase"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", secret, "-f", str(locked)], check=True
    )
    with pytest.raises(AuthenticationFailed) as info:
        SSHTransport("testbox", identity_files=[locked]).run(["true"])
    assert "passphrase" in str(info.value) and "ssh-add" in info.value.hint
    assert secret not in str(info.value) + info.value.hint


def test_dropped_connection_raises_and_reconnect_recovers(
    ssh_home: SSHHome, sshd: SSHServer
) -> None:
    t = SSHTransport("testbox")
    stream = t.stream(["sh", "-c", "echo started; sleep 30"])
    assert next(stream) == b"started\n"
    sshd.stop()
    try:
        with pytest.raises(ConnectionFailed, match="lost"):
            list(stream)
        with pytest.raises(ConnectionFailed):
            t.run(["true"])
    finally:
        sshd.start()
    t.reconnect()
    assert t.run(["echo", "back"]).stdout == b"back\n"
    assert t.connections_opened == 2
    t.close()


def test_connection_dropped_during_run(ssh_home: SSHHome, sshd: SSHServer) -> None:
    t = SSHTransport("testbox")
    t.run(["true"])
    stopper = threading.Timer(0.5, sshd.stop)
    stopper.start()
    try:
        with pytest.raises(ConnectionFailed, match="lost while running sleep"):
            t.run(["sleep", "30"], timeout=20)
    finally:
        stopper.join()
        sshd.start()
    t.close()


def test_killed_command_is_not_a_lost_connection(transport: Transport) -> None:
    result = transport.run(["sh", "-c", "kill -9 $$"])
    # Locally a shell-style 128+9; over SSH the server reports a signal, not a status: -1.
    expected = -1 if isinstance(transport, SSHTransport) else 137
    assert result.exit_code == expected
    assert transport.run(["echo", "still"]).stdout == b"still\n"


def test_no_agent_in_tests() -> None:
    assert "SSH_AUTH_SOCK" not in os.environ
