"""dflash's SSH resolution against OpenSSH's own (`ssh -G`), field by field.

Each case writes an ssh_config (and the files it includes) into a private HOME and compares, for
the keys dflash uses, what `ssh -G` prints with what dflash resolves, on both of its paths: asking
ssh (`use_ssh=True`) and its own parser for machines without ssh (`use_ssh=False`).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from dflash_ops.connect import ssh_config_parser, ssh_tokens
from dflash_ops.connect.ssh_config import lookup

pytestmark = pytest.mark.skipif(shutil.which("ssh") is None, reason="needs the ssh client")

UP = "../" * 12  # climbs to / from any home, so `~/` and relative paths meet the same file
INCLUDED = {
    "inc1.conf": "Host a\n    User inc\n",
    "conf.d/10-a.conf": "Host a\n    Port 2210\n",
    "conf.d/20-b.conf": "Host a\n    Port 2220\n    User b\n",
    "inc2.conf": "User fromblock\nPort 2230\n",
    "flag_flagged": "",
}
# (config text with {d} = the case folder, host, keyword arguments of lookup)
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("", "plainhost", {}),
    ("Host a\n HostName 10.1.2.3\n User bob\n Port 2222\n", "a", {}),
    ("Host a\n HostName 10.1.2.3\n User bob\n Port 2222\n", "a", {"user": "carol", "port": 2200}),
    ("Host gpu[12]\n User lit\n", "gpu1", {}),
    ("Host gpu[12]\n User lit\n", "gpu[12]", {}),
    ("Host *.lab !bad.lab\n User lab\n", "x.lab", {}),
    ("Host *.lab !bad.lab\n User lab\n", "bad.lab", {}),
    ("Host a?c\n Port 2201\n", "abc", {}),
    ("Host FOO*\n User up\n", "FOO1", {}),
    ("Host foo*\n User low\n", "FOO1", {}),
    ("Host a\n User alice # ops\n", "a", {}),
    ("Host a # the lab box\n Port 2202\n", "a", {}),
    ('Host a\n IdentityFile "{d}/with space/id"\n IdentityFile ~/.ssh/id_%h_%r\n', "a", {}),
    ('Host a\n UserKnownHostsFile ~/kh_%h "{d}/k h/%n" %d/x\n', "a", {}),
    ("Host a\n UserKnownHostsFile none\n", "a", {}),
    ("Include {d}/inc1.conf\n", "a", {}),
    ("Include {d}/conf.d/*.conf\n", "a", {}),
    ("Host a\n Include {d}/inc2.conf\n", "a", {}),
    ("Host a\n Include {d}/inc2.conf\n", "b", {}),
    ("Include ~/" + UP + "{d}/inc1.conf\n", "a", {}),
    ("Include " + UP + "{d}/conf.d/2*.conf\n", "a", {}),
    ("Include nonexistent-dflash-test.conf\nHost a\n User r\n", "a", {}),
    ("Match host 10.*\n User m\nHost a\n HostName 10.0.0.1\n", "a", {}),
    ("Host a\n HostName 10.0.0.1\nMatch host 10.*\n User m\n", "a", {}),
    ("Match originalhost A\n Port 2240\n", "a", {}),
    ("Match user bob\n Port 2250\n", "a", {"user": "bob"}),
    ("Match user bob\n Port 2250\n", "bob@a", {}),
    ("Match user bob\n Port 2250\n", "a", {}),
    ("Match localuser " + ssh_tokens.local_user() + "\n Port 2260\n", "a", {}),
    ("Match !localuser nobody-xyz\n Port 2261\n", "a", {}),
    ('Match exec "test -e {d}/flag_%h"\n User execd\n', "flagged", {}),
    ('Match exec "test -e {d}/flag_%h"\n User execd\n', "other", {}),
    ('Match exec "test %r = bob"\n Port 2270\n', "a", {"user": "bob"}),
    ("Match all\n User everyone\n", "a", {}),
    ("Match host a exec false\n Port 2280\n", "a", {}),
    ("Host a\n ProxyJump j1,u@j2:2200\n", "a", {}),
    ("Host a\n ProxyCommand ssh -W %h:%p jump\n", "a", {}),
    ("Host a\n ProxyCommand none\n", "a", {}),
    ('Host a\n ProxyCommand sh -c "nc %h %p"  # kept  \n', "a", {}),
    ("Host a\n ProxyCommand nc %h %p\n ProxyJump j\n", "a", {}),
    ("Host a\n ProxyJump j\n", "a", {"proxy_jump": "none"}),
    ("", "a", {"proxy_jump": "j3"}),
    ("Host a\n IdentitiesOnly yes\n", "a", {}),
    (
        "Host a\n HostKeyAlias myalias\n StrictHostKeyChecking accept-new\n HashKnownHosts yes\n",
        "a",
        {},
    ),
    ("Host *\n StrictHostKeyChecking no\n", "a", {}),
    ("Host a\n ConnectTimeout 7\n", "a", {}),
    ("Host a\n ConnectTimeout 1m\n", "a", {}),
    ("Host a\n ConnectTimeout none\n ConnectTimeout 4\n", "a", {}),
    ("Host a\n ServerAliveInterval 7\n ServerAliveCountMax 2\n", "a", {}),
    ("Host a\n ServerAliveInterval 1m30s\n ServerAliveCountMax 0\n", "a", {}),
    (
        "Host a\n ServerAliveInterval none\n ServerAliveInterval 5\nHost *\n ServerAliveInterval 9\n",
        "a",
        {},
    ),
    ("Host a\n HostName %h.example.com\n", "a", {}),
    ("Host=a\n Port=2290\n", "a", {}),
    ("Host a\n User first\nHost *\n User second\n Port 2300\n", "a", {}),
    ('Host "a" c\n User q\n', "a", {}),
    ("Host a\n GlobalKnownHostsFile {d}/g1 {d}/g2\n", "a", {}),
    ("Host a\n\tUser tabbed\n", "a", {}),
    ("Host a\n IdentityFile ~/.ssh/k1\nHost *\n IdentityFile ~/.ssh/k2\n", "a", {}),
    ("Host !a *\n User notA\n", "a", {}),
    ("Host !a *\n User notA\n", "b", {}),
    ("Host A\n HostName UPPER.Example\n", "A", {}),
    (
        "Host a\n IdentityFile ~/.ssh/k1\n IdentityFile ~/.ssh/k1\n IdentityFile ~/.ssh/k0\n",
        "a",
        {},
    ),
    ("Match final\n User fin\nMatch canonical\n Port 2400\n", "a", {}),
    ("Host a,b\n User comma\nMatch host a,b\n Port 2403\n", "a", {}),
    ("Match canonical\n Port 2401\nHost a\n Port 2402\n", "a", {}),
    ("Host a\n HostName 10.9.8.7\nMatch final host 10.9.*\n IdentityFile ~/.ssh/fin_%h\n", "a", {}),
]


def _flags(host: str, kwargs: dict[str, Any]) -> list[str]:
    flags = []
    if "user" in kwargs:
        flags += ["-l", kwargs["user"]]
    if "port" in kwargs:
        flags += ["-p", str(kwargs["port"])]
    if "proxy_jump" in kwargs:
        flags += ["-o", f"ProxyJump={kwargs['proxy_jump']}"]
    user, _, bare = host.rpartition("@")
    if user and "user" not in kwargs:
        flags += ["-l", user]
    return [*flags, bare]


def _openssh(config: Path, host: str, kwargs: dict[str, Any], home: Path) -> dict[str, str]:
    """What ssh -G prints for the keys dflash reads; its home (`~`) written as $HOME."""
    done = subprocess.run(
        ["ssh", "-G", "-F", str(config), *_flags(host, kwargs)],
        capture_output=True,
        text=True,
        check=True,
        stdin=subprocess.DEVNULL,
    )
    account = str(ssh_tokens.account_home()).rstrip("/") + "/"
    seen: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in ssh_config_parser.KEYS:
            if key != "identityfile" and value.startswith(account):
                value = f"{home}/{value[len(account) :]}".replace(f" {account}", f" {home}/")
            seen.setdefault(key, []).append(value)
    return {key: "\n".join(values) for key, values in seen.items()}


def _flat(values: dict[str, list[str]]) -> dict[str, str]:
    joined = {"userknownhostsfile", "globalknownhostsfile"}
    return {k: (" " if k in joined else "\n").join(v) for k, v in values.items()}


def _write_case(folder: Path, text: str) -> Path:
    for name, body in INCLUDED.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(body)
    config = folder / "config"
    config.write_text(text.replace("{d}", str(folder).lstrip("/") if UP in text else str(folder)))
    return config


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(home))
    return home


def test_both_paths_agree_with_openssh_on_every_config(home: Path, tmp_path: Path) -> None:
    assert len(CASES) >= 40
    disagreements = []
    for number, (text, host, kwargs) in enumerate(CASES):
        folder = tmp_path / f"case{number}"
        config = _write_case(folder, text)
        expected = _openssh(config, host, kwargs, home)
        for use_ssh in (True, False):
            got = _flat(lookup(host, config_path=config, use_ssh=use_ssh, **kwargs))
            if got != expected:
                diff = {
                    k: (got.get(k), expected.get(k))
                    for k in expected.keys() | got.keys()
                    if got.get(k) != expected.get(k)
                }
                disagreements.append((number, text, host, use_ssh, diff))
    assert not disagreements, "\n".join(map(str, disagreements))
