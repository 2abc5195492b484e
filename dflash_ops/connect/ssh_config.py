"""Where an SSH connection goes: the destination resolved exactly as OpenSSH resolves it.

Resolution is OpenSSH's own: `resolve` asks the `ssh` client once (`ssh -G [-F file] [-l user]
[-p port] [-o ProxyJump=…] host`) and reads host name, user, port, identity files,
IdentitiesOnly, ProxyJump, ProxyCommand, the known-hosts files, HostKeyAlias,
StrictHostKeyChecking, HashKnownHosts, ConnectTimeout and ServerAliveInterval/ServerAliveCountMax
(the keepalive that notices a dead peer, `keepalive`) from its answer. The client is required
for an SSH or Proxmox target (`SSHClientMissing` says how to install it; `dflash doctor` checks
it): nothing here re-implements its reading of ssh_config. Explicit values (flags, deploy.toml)
are passed as ssh's own flags, so they win as they would on ssh's command line; the user
defaults to the local account, as ssh's does.

Host and user names are checked before anything reads a config (`ssh_names`): a `Match exec`
line substitutes them into a shell command.

`~` means $HOME. `ssh` itself takes `~` (and the folder of a relative `Include`) from the
password database, so when $HOME points elsewhere (a test, a sandbox) ssh would read other files
than dflash is pointed at: dflash then passes `-F $HOME/.ssh/config` (no /etc/ssh/ssh_config,
as with any `-F`) and maps the account home in ssh's answer to $HOME.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_ops.connect import ssh_names, ssh_tokens
from dflash_ops.connect.keepalive import AliveSettings
from dflash_ops.connect.shell import quote_argv
from dflash_ops.errors import ConfigError, SSHClientMissing

DEFAULT_PORT = 22
SYSTEM_KNOWN_HOSTS = (Path("/etc/ssh/ssh_known_hosts"), Path("/etc/ssh/ssh_known_hosts2"))
_MAX_JUMPS = 8
_PATH_KEYS = ("userknownhostsfile", "globalknownhostsfile", "identityfile")
# What dflash reads of `ssh -G`'s answer.
KEYS = frozenset({
    "hostname", "user", "port", "identityfile", "identitiesonly", "proxyjump", "proxycommand",
    "userknownhostsfile", "globalknownhostsfile", "hostkeyalias", "stricthostkeychecking",
    "hashknownhosts", "connecttimeout", "serveraliveinterval", "serveralivecountmax",
})  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class SSHTarget:
    """A fully resolved SSH destination. `alias` is what the user wrote; `hostname` is dialled."""

    alias: str
    hostname: str
    port: int = DEFAULT_PORT
    user: str
    identity_files: tuple[Path, ...] = ()
    identities_only: bool = False
    known_hosts_files: tuple[Path, ...] = ()  # the user's; new keys are added to the first
    system_known_hosts_files: tuple[Path, ...] = SYSTEM_KNOWN_HOSTS
    proxy_jump: SSHTarget | None = None
    proxy_command: str | None = None  # tokens expanded; run by /bin/sh as ssh does
    host_key_alias: str | None = None
    strict_host_key_checking: str = "ask"  # as ssh -G prints it: true, false, ask, accept-new
    hash_known_hosts: bool = False
    connect_timeout: float = 10.0
    alive: AliveSettings = AliveSettings()  # ServerAliveInterval, ServerAliveCountMax

    @property
    def description(self) -> str:
        return f"{self.user}@{self.hostname}:{self.port}"

    @property
    def user_known_hosts(self) -> Path:
        """The known_hosts file that new keys are added to."""
        if self.known_hosts_files:
            return self.known_hosts_files[0]
        return _home() / ".ssh" / "known_hosts"

    @property
    def known_hosts_name(self) -> str:
        """How known_hosts names this host: HostKeyAlias, else `host` or `[host]:port`."""
        if self.host_key_alias:
            return self.host_key_alias
        return self.hostname if self.port == DEFAULT_PORT else f"[{self.hostname}]:{self.port}"


def _home() -> Path:
    return Path.home()


def _parse_port(text: str | int, where: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ConfigError(f"Invalid port {text!r} in {where}: use a number between 1 and 65535.")
    return port


def _split_jump(spec: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (or `ssh://user@host:port`) → (user, host, port), checked."""
    spec = spec.removeprefix("ssh://")
    user, _, hostport = spec.rpartition("@")
    port: int | None = None
    if hostport.startswith("["):  # [v6addr]:port
        host, _, rest = hostport[1:].partition("]")
        if rest.startswith(":"):
            port = _parse_port(rest[1:], f"ProxyJump {spec!r}")
    elif hostport.count(":") == 1:
        host, _, port_text = hostport.partition(":")
        port = _parse_port(port_text, f"ProxyJump {spec!r}")
    else:
        host = hostport
    ssh_names.check_host(host, where=f"ProxyJump {spec!r}")
    if user:
        ssh_names.check_user(user, where=f"ProxyJump {spec!r}")
    return (user or None), host, port


@dataclass(frozen=True)
class _Request:
    """One question for `ssh -G`: the names checked, the explicit values given."""

    host: str
    user: str | None = None
    port: int | None = None
    jump: str | None = None


def _dash_f(config_path: Path | None, home: Path) -> Path | None:
    """The `-F` that makes `ssh -G` read the files dflash is pointed at: the given file; else
    none when $HOME is the account's home (ssh reads ~/.ssh/config and /etc/ssh/ssh_config as
    it always does); else $HOME's own config (or /dev/null without one)."""
    if config_path is not None:
        return config_path
    if home.resolve() == ssh_tokens.account_home().resolve():
        return None
    user_file = home / ".ssh" / "config"
    return user_file if user_file.is_file() else Path("/dev/null")


def ssh_client() -> str:
    """The `ssh` client on PATH; `SSHClientMissing` (with how to install it) without one."""
    found = shutil.which("ssh")
    if found is None:
        raise SSHClientMissing(
            "The ssh client is not installed on this machine: dflash reads the SSH "
            "configuration through it (ssh -G).",
            hint="Install OpenSSH's client: apt-get install openssh-client (Debian, Ubuntu), "
            "dnf install openssh-clients (Fedora, RHEL), brew install openssh (macOS).",
        )
    return found


def _ask_ssh(request: _Request, dash_f: Path | None) -> dict[str, list[str]]:
    """One `ssh -G` → {key: values} for the keys we use."""
    argv = [ssh_client(), "-G"]
    if dash_f is not None:
        argv += ["-F", str(dash_f)]
    if request.user is not None:
        argv += ["-l", request.user]
    if request.port is not None:
        argv += ["-p", str(request.port)]
    if request.jump is not None:
        argv += ["-o", f"ProxyJump={request.jump}"]
    argv.append(request.host)
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError(f"ssh -G {request.host} did not answer: {exc}") from None
    if done.returncode != 0:
        why = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "no message"
        raise ConfigError(f"ssh refuses the configuration for {request.host!r}: {why}")
    values: dict[str, list[str]] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition(" ")
        if key in KEYS:
            values.setdefault(key, []).append(value)
    for key in ("userknownhostsfile", "globalknownhostsfile"):
        if key in values:
            values[key] = _split_paths(values[key][0])
    return values


def _split_paths(text: str) -> list[str]:
    """ssh -G prints a list of expanded paths joined by spaces; a word that is not a path
    start belongs to the previous path (a quoted name with a space)."""
    paths: list[str] = []
    for word in text.split(" "):
        if paths and not word.startswith(("/", "~")):
            paths[-1] += " " + word
        else:
            paths.append(word)
    return paths


def _rehome(values: dict[str, list[str]], home: Path) -> dict[str, list[str]]:
    """Map the account home (ssh's `~`) to $HOME in ssh's answer, when they differ."""
    account = str(ssh_tokens.account_home()).rstrip("/") + "/"
    if Path(account).resolve() == home.resolve():
        return values
    mine = str(home).rstrip("/") + "/"
    return {
        key: [
            mine + item[len(account) :] if key in _PATH_KEYS and item.startswith(account) else item
            for item in items
        ]
        for key, items in values.items()
    }


def lookup(
    host: str,
    *,
    user: str | None = None,
    port: int | None = None,
    proxy_jump: str | None = None,
    config_path: Path | None = None,
) -> dict[str, list[str]]:
    """What `ssh -G` says for these settings, the paths in it under $HOME."""
    host_user, host = ssh_names.split_user_host(host)
    user = user or host_user
    if user is not None:
        ssh_names.check_user(user, where="user")
    home = _home()
    request = _Request(host=host, user=user, port=port, jump=proxy_jump)
    return _rehome(_ask_ssh(request, _dash_f(config_path, home)), home)


def resolve(
    host: str,
    *,
    user: str | None = None,
    port: int | None = None,
    identity_files: list[Path] | tuple[Path, ...] | None = None,
    known_hosts_files: list[Path] | tuple[Path, ...] | None = None,
    proxy_jump: str | None = None,
    config_path: Path | None = None,
    _depth: int = 0,
) -> SSHTarget:
    """Resolve `host` (an alias or address, optionally `user@host`) into an `SSHTarget`.

    Explicit arguments win over ssh_config, which wins over OpenSSH's defaults.
    `proxy_jump="none"` disables a ProxyJump set in the config.
    """
    host_user, host = ssh_names.split_user_host(host)
    user = user or host_user
    if port is not None:
        port = _parse_port(port, "--port")
    if _depth > _MAX_JUMPS:
        raise ConfigError(f"ProxyJump chain through {host!r} is longer than {_MAX_JUMPS} hops.")
    values = lookup(
        host,
        user=user,
        port=port,
        proxy_jump=proxy_jump,
        config_path=config_path,
    )
    target = _target(host, values)
    if identity_files is not None:
        target = replace(target, identity_files=tuple(identity_files))
    if known_hosts_files is not None:
        target = replace(target, known_hosts_files=tuple(known_hosts_files))
    jump_spec = values.get("proxyjump", [None])[0]
    if jump_spec:
        target = replace(target, proxy_jump=_resolve_jumps(jump_spec, config_path, _depth))
    return target


def _resolve_jumps(spec: str, config_path: Path | None, depth: int) -> SSHTarget:
    """`a,b`: reach a (with its own config), from a reach b, from b the target."""
    jump: SSHTarget | None = None
    for hop in spec.split(","):
        hop_user, hop_host, hop_port = _split_jump(hop.strip())
        hop_target = resolve(
            hop_host,
            user=hop_user,
            port=hop_port,
            config_path=config_path,
            proxy_jump="none" if jump is not None else None,
            _depth=depth + 1,
        )
        if jump is not None:
            hop_target = replace(hop_target, proxy_jump=jump)
        jump = hop_target
    assert jump is not None
    return jump


def _target(alias: str, values: dict[str, list[str]]) -> SSHTarget:
    """The target that ssh's answer describes (tokens and `~` expanded as ssh would)."""
    home = _home()

    def one(key: str, default: str = "") -> str:
        return values.get(key, [default])[0]

    hostname, user = one("hostname", alias), one("user") or ssh_tokens.local_user()
    port = _parse_port(one("port", "22"), f"the SSH configuration of {alias}")
    tokens = ssh_tokens.tokens(host=hostname, original=alias, port=str(port), user=user, home=home)

    def path(text: str, key: str) -> Path:
        return Path(ssh_tokens.expand(ssh_tokens.expand_tilde(text, home), tokens, where=key))

    proxy_command = one("proxycommand") or None
    if proxy_command is not None:
        proxy_command = ssh_tokens.expand(proxy_command, tokens, where="ProxyCommand")
    timeout = one("connecttimeout", "none")
    return SSHTarget(
        alias=alias,
        hostname=hostname,
        port=port,
        user=user,
        identity_files=tuple(path(p, "IdentityFile") for p in values.get("identityfile", [])),
        identities_only=one("identitiesonly", "no") == "yes",
        known_hosts_files=tuple(
            path(p, "UserKnownHostsFile")
            for p in values.get("userknownhostsfile", [])
            if p != "none"
        ),
        system_known_hosts_files=tuple(
            path(p, "GlobalKnownHostsFile")
            for p in values.get("globalknownhostsfile", [])
            if p != "none"
        ),
        proxy_command=proxy_command,
        host_key_alias=one("hostkeyalias") or None,
        strict_host_key_checking=one("stricthostkeychecking", "ask"),
        hash_known_hosts=one("hashknownhosts", "no") == "yes",
        connect_timeout=float(timeout) if timeout.isdigit() and int(timeout) > 0 else 10.0,
        alive=AliveSettings.of(
            float(one("serveraliveinterval", "0")), int(one("serveralivecountmax", "3"))
        ),
    )


def ssh_command(
    target: SSHTarget, remote: Sequence[str], *, tty: bool = False, verbose: bool = False
) -> list[str]:
    """The OpenSSH client's argv that reaches `target` as dflash does — the same config file
    (`-F` when $HOME is not the account's home), port and user — and runs `remote` there, one
    word quoted for the remote shell. `tty`: with a terminal (`-t`)."""
    dash_f = _dash_f(None, _home())
    argv = ["ssh", *(["-v"] if verbose else []), *(["-t"] if tty else [])]
    argv += ["-F", str(dash_f)] if dash_f is not None else []
    return [*argv, "-p", str(target.port), f"{target.user}@{target.alias}", quote_argv(remote)]


def try_command(target: SSHTarget, *, verbose: bool = False) -> str:
    """The `ssh` command that tries the same destination by hand, its port and user kept (a
    hint without `-p` would try port 22, and another account)."""
    return quote_argv(ssh_command(target, ["true"], verbose=verbose))


# The placeholders of the connection errors' hints (errors.py), and what stands for them.
_BY_HAND = (("ssh -v <user>@<host> true", True), ("ssh -v <host> true", True),
            ("ssh <host> true", False))  # fmt: skip


def by_hand(hint: str, target: SSHTarget) -> str:
    """`hint` with its `ssh … <host> true` placeholder replaced by the real command."""
    for placeholder, verbose in _BY_HAND:
        hint = hint.replace(placeholder, try_command(target, verbose=verbose))
    return hint
