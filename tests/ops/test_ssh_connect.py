"""What resolution hands to the connection, exercised against the real sshd: ProxyCommand run
by /bin/sh, IdentitiesOnly without IdentityFile using the default keys, known_hosts2 read by
default, the local account as the default user, and an Include'd Host block."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dflash_ops.connect.ssh_config import resolve
from dflash_ops.connect.ssh_tokens import local_user
from dflash_ops.connect.transport import SSHTransport
from dflash_ops.errors import SSHClientMissing
from tests.fixtures.ssh import SSHHome, SSHServer


def _append(home: SSHHome, text: str) -> None:
    with home.config.open("a") as handle:
        handle.write(text)


def test_defaults_of_openssh(ssh_home: SSHHome, sshd: SSHServer) -> None:
    """No User, no IdentityFile, no UserKnownHostsFile: the local account, ~/.ssh/id_*, and
    ~/.ssh/known_hosts2 (where the key is) are what ssh would use."""
    ssh_dir = ssh_home.home / ".ssh"
    shutil.copy(sshd.client_key, ssh_dir / "id_ed25519")
    (ssh_dir / "known_hosts2").write_text(sshd.known_hosts_lines())
    (ssh_dir / "inc").mkdir()
    (ssh_dir / "inc" / "dk.conf").write_text(
        f"Host dk\n    HostName 127.0.0.1\n    Port {sshd.port}\n    IdentitiesOnly yes\n"
    )
    # absolute: a relative Include under `ssh -F` is read from the account's ~/.ssh
    include = f"Include {ssh_dir}/inc/*.conf\n"
    ssh_home.config.write_text(include + ssh_home.config.read_text())
    target = resolve("dk")
    assert target.user == local_user() == sshd.user
    assert ssh_dir / "id_ed25519" in target.identity_files and target.identities_only
    assert target.known_hosts_files == (ssh_dir / "known_hosts", ssh_dir / "known_hosts2")
    transport = SSHTransport(target)
    assert transport.run(["echo", "ok"]).stdout == b"ok\n"
    transport.close()


@pytest.mark.skipif(shutil.which("ssh") is None, reason="the ProxyCommand runs ssh -W")
def test_proxy_command(ssh_home: SSHHome, sshd: SSHServer, tmp_path: Path) -> None:
    marker = tmp_path / "proxied"
    _append(
        ssh_home,
        f"""
Host viacmd
    HostName 127.0.0.1
    Port {sshd.port}
    User root
    IdentityFile {sshd.client_key}
    IdentitiesOnly yes
    UserKnownHostsFile {ssh_home.known_hosts}
    ProxyCommand ssh -E {marker} -F {ssh_home.config} -W %h:%p testbox
""",
    )
    target = resolve("viacmd")
    assert target.proxy_command is not None and f"-W 127.0.0.1:{sshd.port}" in target.proxy_command
    transport = SSHTransport(target)
    assert transport.run(["echo", "proxied"]).stdout == b"proxied\n"
    transport.close()
    assert marker.exists()  # the command ran (ssh -E wrote its log there)


def test_without_the_ssh_client_resolution_says_how_to_install_it(
    ssh_home: SSHHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SSHClientMissing) as info:
        resolve(ssh_home.alias)
    assert "ssh -G" in str(info.value) and "apt-get install openssh-client" in info.value.hint
