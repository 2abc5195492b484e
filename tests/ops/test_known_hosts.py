"""known_hosts judged as `ssh -o StrictHostKeyChecking=yes` judges it, against the real sshd.

Every case writes known_hosts files, then connects twice to the fixture server: with OpenSSH's
client (the reference) and with dflash. Both must reach the same verdict, and it must be the one
written in the case: accepted, unknown, changed or revoked.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from dflash_ops.connect import known_hosts
from dflash_ops.connect.transport import SSHTransport
from dflash_ops.errors import HostKeyChanged, HostKeyRevoked, HostKeyUnknown
from tests.fixtures.ssh import SSHServer

KINDS = {"ok": None, "unknown": HostKeyUnknown, "changed": HostKeyChanged}
KINDS["revoked"] = HostKeyRevoked


def _key(folder: Path, name: str, kind: str) -> str:
    path = folder / name
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(path)], check=True)
    return " ".join(Path(f"{path}.pub").read_text().split()[:2])


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory, sshd: SSHServer) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("keys")
    return {
        "K": sshd.host_public_key,  # what the server presents
        "O": _key(folder, "other", "ed25519"),  # same type, another key
        "E": _key(folder, "ecdsa", "ecdsa"),  # a stale key of another type
    }


def _cases(port: int) -> list[tuple[str, str, str, str]]:
    """(what, known_hosts text with {K}/{O}/{E}/{N}, known_hosts2 text, expected verdict)."""
    return [
        ("plain", "{N} {K}\n", "", "ok"),
        ("hashed", "{H} {K}\n", "", "ok"),
        ("hashed, another host", "{HX} {K}\n", "", "unknown"),
        ("wildcard", "[127.0.0.*]:{P} {K}\n", "", "ok"),
        ("star", "* {K}\n", "", "ok"),
        ("negated, then found without port", "*,!{N} {K}\n", "", "ok"),
        ("negated both", "*,!{N},!127.0.0.1 {K}\n", "", "unknown"),
        ("without port", "127.0.0.1 {K}\n", "", "ok"),
        ("without port, another key", "127.0.0.1 {O}\n", "", "unknown"),
        ("without port, revoked", "127.0.0.1 {K}\n@revoked 127.0.0.1 {K}\n", "", "revoked"),
        ("another key", "{N} {O}\n", "", "changed"),
        ("stale other type first", "{N} {E}\n{N} {K}\n", "", "ok"),
        ("stale same type first", "{N} {O}\n{N} {K}\n", "", "ok"),
        ("only another type", "{N} {E}\n", "", "changed"),
        ("revoked", "@revoked {N} {K}\n{N} {K}\n", "", "revoked"),
        ("revoked by wildcard", "@revoked * {K}\n{N} {K}\n", "", "revoked"),
        ("revoked other key", "@revoked * {O}\n{N} {K}\n", "", "ok"),
        ("cert-authority beside", "@cert-authority * {O}\n{N} {K}\n", "", "ok"),
        ("cert-authority only", "@cert-authority * {K}\n", "", "unknown"),
        ("in known_hosts2", "", "{N} {K}\n", "ok"),
        ("garbage lines", "# c\n\n{N} not-a-key AAAA\n@bogus {N} {K}\n{N} {K}\n", "", "ok"),
        ("unknown marker only", "@bogus {N} {K}\n", "", "unknown"),
        ("empty", "", "", "unknown"),
    ]


def _home(tmp_path: Path, sshd: SSHServer, monkeypatch: pytest.MonkeyPatch, extra: str) -> Path:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    config = home / ".ssh" / "config"
    config.write_text(
        f"Host kh\n    HostName 127.0.0.1\n    Port {sshd.port}\n    User root\n"
        f"    IdentityFile {sshd.client_key}\n    IdentitiesOnly yes\n"
        f"    UserKnownHostsFile {home}/kh1 {home}/kh2\n"
        "    GlobalKnownHostsFile /dev/null\n    CheckHostIP no\n" + extra
    )
    monkeypatch.setenv("HOME", str(home))
    return config


def _openssh_verdict(config: Path) -> str:
    done = subprocess.run(
        [
            "ssh",
            "-F",
            str(config),
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "kh",
            "true",
        ],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=30,
    )
    text = done.stderr.upper()
    if done.returncode == 0:
        return "ok"
    if "REVOKED" in text:
        return "revoked"
    if "HAS CHANGED" in text:
        return "changed"
    assert "HOST KEY VERIFICATION FAILED" in text, done.stderr
    return "unknown"


def _dflash_verdict() -> str:
    transport = SSHTransport("kh")
    try:
        transport.connect()
    except (HostKeyUnknown, HostKeyChanged, HostKeyRevoked) as exc:
        return next(k for k, v in KINDS.items() if v is type(exc))
    finally:
        transport.close()
    return "ok"


def _fill(text: str, keys: dict[str, str], port: int) -> str:
    name = f"[127.0.0.1]:{port}"
    return text.format(
        N=name,
        P=port,
        H=known_hosts.hashed_name(name),
        HX=known_hosts.hashed_name("[127.0.0.2]:1"),
        **keys,
    )


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the ssh client")
def test_every_case_as_openssh_judges_it(
    sshd: SSHServer, keys: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _home(tmp_path, sshd, monkeypatch, "")
    home = config.parent.parent
    results = []
    for what, first, second, expected in _cases(sshd.port):
        (home / "kh1").write_text(_fill(first, keys, sshd.port))
        (home / "kh2").write_text(_fill(second, keys, sshd.port))
        results.append((what, expected, _openssh_verdict(config), _dflash_verdict()))
    wrong = [r for r in results if not r[1] == r[2] == r[3]]
    assert not wrong, wrong
    assert len(results) == 23


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the ssh client")
def test_host_key_alias_names_the_entry(
    sshd: SSHServer, keys: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _home(tmp_path, sshd, monkeypatch, "    HostKeyAlias gpu-alias\n")
    home = config.parent.parent
    (home / "kh2").write_text("")
    for text, expected in (("gpu-alias {K}\n", "ok"), ("{N} {K}\n", "unknown")):
        (home / "kh1").write_text(_fill(text, keys, sshd.port))
        assert _openssh_verdict(config) == _dflash_verdict() == expected


@pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the ssh client")
def test_new_key_written_hashed_and_openssh_accepts_it(
    sshd: SSHServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _home(tmp_path, sshd, monkeypatch, "    HashKnownHosts yes\n")
    home = config.parent.parent
    transport = SSHTransport("kh", accept_new_host_key=True)
    transport.connect()
    transport.close()
    written = (home / "kh1").read_text()
    assert written.startswith("|1|") and "127.0.0.1" not in written
    assert _openssh_verdict(config) == "ok"
    assert _dflash_verdict() == "ok"


def test_revoked_and_changed_messages_name_the_line(
    sshd: SSHServer, keys: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = _home(tmp_path, sshd, monkeypatch, "")
    home = config.parent.parent
    (home / "kh1").write_text(_fill("# first\n@revoked * {K}\n", keys, sshd.port))
    with pytest.raises(HostKeyRevoked) as info:
        SSHTransport("kh", accept_new_host_key=True).connect()
    assert f"{home}/kh1:2" in str(info.value) and sshd.host_key_fingerprint in str(info.value)
    (home / "kh1").write_text(_fill("{N} {E}\n{N} {O}\n", keys, sshd.port))
    with pytest.raises(HostKeyChanged) as changed:
        SSHTransport("kh", accept_new_host_key=True).connect()
    assert f"{home}/kh1:2" in str(changed.value) and "ssh-keygen -R" in changed.value.hint
