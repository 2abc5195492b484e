"""Where an SSH connection goes and how it is opened: `~/.ssh/config`, known hosts, ProxyJump.

Resolution order for every setting is: explicit value > `~/.ssh/config` > default (port 22,
user root). paramiko parses `~/.ssh/config` but applies none of it, so `resolve` does; it also
does not follow ProxyJump, so `connect` opens the jump host first and tunnels through it with a
`direct-tcpip` channel passed as `sock=`.

Host keys are never trusted silently: an unknown key raises `HostKeyUnknown` with its SHA256
fingerprint unless the caller passed `accept_new_host_key=True` (the CLI's
`--accept-new-host-key`), in which case it is appended to the user's known_hosts. A key that
differs from the recorded one raises `HostKeyChanged`, flag or not.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import paramiko

from dflash_ops.errors import (
    AuthenticationFailed,
    ConfigError,
    ConnectionFailed,
    HostKeyChanged,
    HostKeyUnknown,
)

log = logging.getLogger(__name__)

DEFAULT_PORT = 22
DEFAULT_USER = "root"
SYSTEM_KNOWN_HOSTS = (Path("/etc/ssh/ssh_known_hosts"), Path("/etc/ssh/ssh_known_hosts2"))
_MAX_JUMPS = 8


@dataclass(frozen=True, kw_only=True)
class SSHTarget:
    """A fully resolved SSH destination. `alias` is what the user wrote; `hostname` is dialled."""

    alias: str
    hostname: str
    port: int = DEFAULT_PORT
    user: str = DEFAULT_USER
    identity_files: tuple[Path, ...] = ()
    identities_only: bool = False
    known_hosts_files: tuple[Path, ...] = ()  # the user's; new keys are added to the first
    system_known_hosts_files: tuple[Path, ...] = SYSTEM_KNOWN_HOSTS
    proxy_jump: SSHTarget | None = None
    connect_timeout: float = 10.0

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
        """How known_hosts names this host (OpenSSH writes `[host]:port` off port 22)."""
        return self.hostname if self.port == DEFAULT_PORT else f"[{self.hostname}]:{self.port}"


def _home() -> Path:
    return Path.home()


def _expand(path: str) -> Path:
    if path == "~" or path.startswith("~/"):
        return _home() / path[2:]
    return Path(path)


def _load_ssh_config(config_path: Path | None) -> paramiko.SSHConfig:
    path = config_path if config_path is not None else _home() / ".ssh" / "config"
    if not path.is_file():
        return paramiko.SSHConfig()
    try:
        return paramiko.SSHConfig.from_path(str(path))
    except (OSError, paramiko.ssh_exception.ConfigParseError) as exc:
        raise ConfigError(f"Cannot read SSH config {path}: {exc}") from exc


def _split_jump(spec: str) -> tuple[str | None, str, int | None]:
    """`[user@]host[:port]` (or `ssh://user@host:port`) → (user, host, port)."""
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
    return (user or None), host, port


def _parse_port(text: str | int, where: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 1 <= port <= 65535:
        raise ConfigError(f"Invalid port {text!r} in {where}: use a number between 1 and 65535.")
    return port


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

    Explicit arguments win over `~/.ssh/config` (HostName, Port, User, IdentityFile,
    IdentitiesOnly, UserKnownHostsFile, GlobalKnownHostsFile, ProxyJump, ConnectTimeout), which
    wins over the defaults. `proxy_jump="none"` disables a ProxyJump set in the config.
    """
    if "@" in host:  # "user@host", as ssh accepts it; an explicit user still wins
        host_user, _, host = host.rpartition("@")
        user = user or host_user or None
    if not host or host.startswith("-") or any(c.isspace() or c == "\x00" for c in host):
        raise ConfigError(f"Invalid SSH host {host!r}: give an address or a ~/.ssh/config alias.")
    if _depth > _MAX_JUMPS:
        raise ConfigError(f"ProxyJump chain through {host!r} is longer than {_MAX_JUMPS} hops.")
    options = _load_ssh_config(config_path).lookup(host)
    where = f"~/.ssh/config (Host {host})"

    hostname = options.get("hostname", host)
    if port is None:
        port = _parse_port(options["port"], where) if "port" in options else DEFAULT_PORT
    user = user or options.get("user") or DEFAULT_USER
    if identity_files is None:
        identity_files = [_expand(p) for p in options.get("identityfile", [])]
    if known_hosts_files is None:
        known_hosts_files = [_expand(p) for p in options.get("userknownhostsfile", "").split()]
        if not known_hosts_files:
            known_hosts_files = [_home() / ".ssh" / "known_hosts"]
    system_files = (
        tuple(_expand(p) for p in options.get("globalknownhostsfile", "").split())
        or SYSTEM_KNOWN_HOSTS
    )
    timeout = float(options["connecttimeout"]) if "connecttimeout" in options else 10.0

    jump_spec = proxy_jump if proxy_jump is not None else options.get("proxyjump")
    jump: SSHTarget | None = None
    if jump_spec and jump_spec.lower() != "none":
        # "a,b" means: reach a, from a reach b, from b reach the target.
        for hop in jump_spec.split(","):
            hop_user, hop_host, hop_port = _split_jump(hop.strip())
            hop_target = resolve(
                hop_host,
                user=hop_user,
                port=hop_port,
                config_path=config_path,
                proxy_jump="none" if jump is not None else None,
                _depth=_depth + 1,
            )
            if jump is not None:
                hop_target = _with_jump(hop_target, jump)
            jump = hop_target

    return SSHTarget(
        alias=host,
        hostname=hostname,
        port=port,
        user=user,
        identity_files=tuple(identity_files),
        identities_only=options.get("identitiesonly", "no").lower() == "yes",
        known_hosts_files=tuple(known_hosts_files),
        system_known_hosts_files=system_files,
        proxy_jump=jump,
        connect_timeout=timeout,
    )


def _with_jump(target: SSHTarget, jump: SSHTarget) -> SSHTarget:
    fields = {name: getattr(target, name) for name in SSHTarget.__dataclass_fields__}
    fields["proxy_jump"] = jump
    return SSHTarget(**fields)


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's fingerprint of a public key: `SHA256:` + unpadded base64 of its digest."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Refuses unknown host keys unless told to accept new ones, then records them."""

    def __init__(self, target: SSHTarget, *, accept_new: bool) -> None:
        self.target = target
        self.accept_new = accept_new

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        store = self.target.user_known_hosts
        if not self.accept_new:
            raise HostKeyUnknown(
                f"The host key of {hostname} is not known: {key.get_name()} {fingerprint(key)}",
                hint=(
                    "Check this fingerprint on the host itself (ssh-keygen -lf "
                    "/etc/ssh/ssh_host_ed25519_key.pub) and, if it matches, run again with "
                    f"--accept-new-host-key to add it to {store}."
                ),
            )
        client.get_host_keys().add(hostname, key.get_name(), key)
        store.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        with store.open("a") as handle:
            handle.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")
        os.chmod(store, 0o600)
        log.warning(
            "added host key %s %s for %s to %s",
            key.get_name(),
            fingerprint(key),
            hostname,
            store,
            extra={"host": hostname},
        )


@dataclass
class Connection:
    """An open, authenticated client and the jump-host clients it tunnels through."""

    client: paramiko.SSHClient
    jumps: list[Connection] = field(default_factory=list)

    @property
    def transport(self) -> paramiko.Transport:
        transport = self.client.get_transport()
        assert transport is not None
        return transport

    def is_active(self) -> bool:
        transport = self.client.get_transport()
        return transport is not None and transport.is_active()

    def close(self) -> None:
        self.client.close()
        for jump in self.jumps:
            jump.close()


def connect(target: SSHTarget, *, accept_new_host_key: bool = False) -> Connection:
    """Open and authenticate one connection to `target` (through its ProxyJump hosts, if any)."""
    jumps: list[Connection] = []
    sock: paramiko.Channel | None = None
    if target.proxy_jump is not None:
        jump = connect(target.proxy_jump, accept_new_host_key=accept_new_host_key)
        jumps.append(jump)
        try:
            sock = jump.transport.open_channel(
                "direct-tcpip",
                (target.hostname, target.port),
                ("127.0.0.1", 0),
                timeout=target.connect_timeout,
            )
        except (paramiko.SSHException, OSError) as exc:
            jump.close()
            raise ConnectionFailed(
                f"Jump host {target.proxy_jump.description} could not reach "
                f"{target.hostname}:{target.port}: {exc}"
            ) from exc

    client = paramiko.SSHClient()
    _load_known_hosts(client, target)
    client.set_missing_host_key_policy(_HostKeyPolicy(target, accept_new=accept_new_host_key))
    try:
        _open(client, target, sock)
    except BaseException:
        client.close()
        for jump in jumps:
            jump.close()
        raise
    transport = client.get_transport()
    if transport is not None:
        transport.set_keepalive(15)  # notice a dead peer during long, quiet commands
    return Connection(client=client, jumps=jumps)


def _load_known_hosts(client: paramiko.SSHClient, target: SSHTarget) -> None:
    """System files, then the user's. Loaded without `load_host_keys(path)`, which would make
    paramiko rewrite that file (dropping its comments) whenever a key is added."""
    loads = [(p, client.load_system_host_keys) for p in target.system_known_hosts_files]
    loads += [(p, client.get_host_keys().load) for p in target.known_hosts_files]
    for path, load in loads:
        if not path.is_file():
            continue
        try:
            load(str(path))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"Cannot read known hosts file {path}: {exc}") from None


def _open(client: paramiko.SSHClient, target: SSHTarget, sock: paramiko.Channel | None) -> None:
    where = f"{target.hostname}:{target.port}"
    key_files = [str(p) for p in target.identity_files if p.is_file()]
    use_agent = not target.identities_only and bool(os.environ.get("SSH_AUTH_SOCK"))
    try:
        client.connect(
            target.hostname,
            port=target.port,
            username=target.user,
            key_filename=key_files or None,
            allow_agent=use_agent,
            look_for_keys=not target.identities_only,
            timeout=target.connect_timeout,
            banner_timeout=target.connect_timeout,
            auth_timeout=target.connect_timeout,
            sock=sock,
        )
    except paramiko.BadHostKeyException as exc:
        raise HostKeyChanged(
            f"The host key of {target.known_hosts_name} has CHANGED: the server presents "
            f"{exc.key.get_name()} {fingerprint(exc.key)}, known_hosts records "
            f"{exc.expected_key.get_name()} {fingerprint(exc.expected_key)}",
            hint=(
                "Someone may be intercepting the connection, or the host was reinstalled. "
                "Confirm the new key with the host's owner, then remove the old entry: "
                f"ssh-keygen -R '{target.known_hosts_name}' -f {target.user_known_hosts}"
            ),
        ) from None
    except paramiko.PasswordRequiredException:
        raise AuthenticationFailed(
            f"{target.user}@{where}: a key file is protected by a passphrase",
            hint="Load the key into ssh-agent (ssh-add <key>) and run again.",
        ) from None
    except paramiko.AuthenticationException:
        tried = ", ".join(key_files) or "no key files"
        agent = " and the SSH agent" if use_agent else ""
        raise AuthenticationFailed(
            f"{target.user}@{where} refused every key offered ({tried}{agent})"
        ) from None
    except (HostKeyUnknown, HostKeyChanged):
        raise
    except paramiko.SSHException as exc:
        if "No authentication methods available" not in str(exc):
            raise ConnectionFailed(f"Cannot connect to {where}: {exc}") from None
        raise AuthenticationFailed(
            f"{target.user}@{where}: no key to offer (no IdentityFile found and no SSH agent)"
        ) from None
    except TimeoutError as exc:
        raise ConnectionFailed(f"Cannot connect to {where}: timed out ({exc})") from None
    except paramiko.ssh_exception.NoValidConnectionsError as exc:
        reasons = "; ".join(sorted({e.strerror or str(e) for e in exc.errors.values()}))
        raise ConnectionFailed(f"Cannot connect to {where}: {reasons}") from None
    except (OSError, EOFError) as exc:
        raise ConnectionFailed(f"Cannot connect to {where}: {exc or type(exc).__name__}") from None
