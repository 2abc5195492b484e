"""Open one authenticated paramiko connection to a resolved `SSHTarget`.

The socket is the target's own TCP connection, a `direct-tcpip` channel through its ProxyJump
host (paramiko does not follow ProxyJump), or its ProxyCommand run by /bin/sh as ssh runs it.

Host keys are judged by `known_hosts` as `ssh -o StrictHostKeyChecking=yes` judges them:
paramiko's own host-key store stays empty, so every key reaches our policy. The key types
known_hosts records for the host are negotiated first (as ssh orders HostKeyAlgorithms). An
unknown key raises `HostKeyUnknown` with its SHA256 fingerprint unless the caller passed
`accept_new_host_key=True` (the CLI's `--accept-new-host-key`) or the config says
`StrictHostKeyChecking accept-new`/`no`; it is then appended to the user's known_hosts (hashed
under `HashKnownHosts yes`). A changed key (`HostKeyChanged`) and a revoked one
(`HostKeyRevoked`) are refused, flag or not.

A failure is one exception naming the place: a port that is no SSH server (`NotAnSSHServer`), a
server that went away mid-handshake (`ConnectionDropped`, never mistaken for a key problem),
refused keys (`AuthenticationFailed`); the message always carries a reason.

An open connection is watched (`keepalive.Watchdog`, the target's ServerAliveInterval and
ServerAliveCountMax): a peer that stops answering is declared dead in bounded time and the
connection closed; `Connection.dead` says why (its own verdict, or a jump host's).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import shlex
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import paramiko

from dflash_ops.connect import known_hosts
from dflash_ops.connect.keepalive import Watchdog
from dflash_ops.connect.ssh_config import SSHTarget, by_hand
from dflash_ops.errors import (
    AuthenticationFailed,
    ConnectionDropped,
    ConnectionFailed,
    HostKeyChanged,
    HostKeyRevoked,
    HostKeyUnknown,
    NotAnSSHServer,
)

log = logging.getLogger(__name__)

# paramiko's host key algorithm names for each key type known_hosts records.
_ALGORITHMS = {"ssh-rsa": ("rsa-sha2-512", "rsa-sha2-256")}


def fingerprint(key: paramiko.PKey) -> str:
    """OpenSSH's fingerprint of a public key: `SHA256:` + unpadded base64 of its digest."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class _HostKeyPolicy(paramiko.MissingHostKeyPolicy):
    """Judges every server key against known_hosts; records new ones only when allowed."""

    def __init__(
        self, target: SSHTarget, entries: list[known_hosts.Entry], *, accept_new: bool
    ) -> None:
        self.target = target
        self.entries = entries
        self.accept_new = accept_new or target.strict_host_key_checking in ("accept-new", "false")

    def missing_host_key(self, client: paramiko.SSHClient, hostname: str, key: Any) -> None:
        name = self.target.known_hosts_name
        bare = self.target.port != 22 and not self.target.host_key_alias
        judged = known_hosts.judge(
            self.entries, name, key.asbytes(), portless=self.target.hostname if bare else None
        )
        shown = f"{key.get_name()} {fingerprint(key)}"
        if judged.verdict is known_hosts.Verdict.OK:
            return
        if judged.verdict is known_hosts.Verdict.REVOKED:
            assert judged.entry is not None
            raise HostKeyRevoked(
                f"The host key of {name} is REVOKED ({shown}): "
                f"{judged.entry.path}:{judged.entry.line} marks it @revoked"
            )
        if judged.verdict is known_hosts.Verdict.CHANGED:
            assert judged.entry is not None
            raise _changed(self.target, shown, judged.entry)
        if not self.accept_new:
            raise _unknown(self.target, shown)
        self._record(key)

    def _record(self, key: Any) -> None:
        name = self.target.known_hosts_name
        store = self.target.user_known_hosts
        known_hosts.append(
            store, name, key.get_name(), key.get_base64(), hashed=self.target.hash_known_hosts
        )
        log.warning(
            "added host key %s %s for %s to %s",
            key.get_name(),
            fingerprint(key),
            name,
            store,
            extra={"host": name},
        )


def _changed(target: SSHTarget, shown: str, entry: known_hosts.Entry) -> HostKeyChanged:
    digest = base64.b64encode(hashlib.sha256(entry.blob).digest()).decode().rstrip("=")
    name = target.known_hosts_name
    return HostKeyChanged(
        f"The host key of {name} has CHANGED: the server presents {shown}, "
        f"{entry.path}:{entry.line} records {entry.key_type} SHA256:{digest}",
        hint=(
            "Someone may be intercepting the connection, or the host was reinstalled. "
            "Confirm the new key with the host's owner, then remove the old entry: "
            f"ssh-keygen -R '{name}' -f {entry.path}"
        ),
    )


def _unknown(target: SSHTarget, shown: str) -> HostKeyUnknown:
    name = target.known_hosts_name
    return HostKeyUnknown(
        f"The host key of {name} is not known: {shown}",
        hint=(
            "Check this fingerprint on the host itself (ssh-keygen -lf "
            "/etc/ssh/ssh_host_ed25519_key.pub) and, if it matches, run again with "
            f"--accept-new-host-key to add it to {target.user_known_hosts}."
        ),
    )


@dataclass
class Connection:
    """An open, authenticated client and the jump-host clients it tunnels through."""

    client: paramiko.SSHClient
    jumps: list[Connection] = field(default_factory=list)
    watchdog: Watchdog | None = None

    @property
    def transport(self) -> paramiko.Transport:
        transport = self.client.get_transport()
        assert transport is not None
        return transport

    def is_active(self) -> bool:
        transport = self.client.get_transport()
        return transport is not None and transport.is_active()

    @property
    def dead(self) -> str | None:
        """Why the keepalive declared this connection (or a jump host's) dead; None if not."""
        own = self.watchdog.dead if self.watchdog is not None else None
        return own or next((j.dead for j in self.jumps if j.dead), None)

    def dropped(self, where: str, running: str = "") -> ConnectionDropped | None:
        """The keepalive's verdict as a command on this connection meets it (None: no verdict,
        the connection failed otherwise)."""
        if not self.dead:
            return None
        doing = f" while running {running}" if running else ""
        return ConnectionDropped(
            f"The connection to {where} dropped{doing}: {self.dead}",
            reason=self.dead,
            hint=(
                "The network or the host stopped answering. A command that was running there "
                "may have gone on until it noticed; check the host (ssh <host> true), then its "
                "state, and run the command again."
            ),
        )

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.client.close()
        for jump in self.jumps:
            jump.close()


def _proxy_command(target: SSHTarget) -> paramiko.ProxyCommand:
    """ssh runs ProxyCommand as `/bin/sh -c 'exec COMMAND'`; so do we."""
    assert target.proxy_command is not None
    return paramiko.ProxyCommand(shlex.join(["/bin/sh", "-c", f"exec {target.proxy_command}"]))


class _Watched:
    """A socket (or channel, or proxy) that counts what it received, keeps its first bytes and
    the time of the last ones: a peer that closed before saying anything dropped the
    connection; one that spoke, but no SSH banner line, is no sshd (whether it then closed or
    reset the connection); one that stays silent is probed by the keepalive."""

    HEAD = 4096

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self.received = 0
        self.head = b""
        self.peer_closed = False  # the peer closed or reset its side
        self.opened = time.monotonic()
        self.last_received = self.opened

    def recv(self, size: int) -> bytes:
        try:
            data: bytes = self._sock.recv(size)
        except ConnectionError:
            self.peer_closed = True
            raise
        if data:
            self.last_received = time.monotonic()
        self.received += len(data)
        self.peer_closed = self.peer_closed or (size > 0 and not data)
        if len(self.head) < self.HEAD:
            self.head += data[: self.HEAD - len(self.head)]
        return data

    def silent_for(self, seconds: float) -> bool:
        """The peer took the connection and, for `seconds`, neither spoke nor closed it."""
        waited = time.monotonic() - self.opened
        return not self.received and not self.peer_closed and waited >= seconds

    @property
    def spoke_ssh(self) -> bool:
        """An SSH banner line (`SSH-…`) is among what the peer sent first."""
        return self.head.startswith(b"SSH-") or b"\nSSH-" in self.head

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _socket(target: SSHTarget, jumps: list[Connection], accept_new: bool) -> _Watched:
    return _Watched(_raw_socket(target, jumps, accept_new))


def _raw_socket(target: SSHTarget, jumps: list[Connection], accept_new: bool) -> Any:
    if target.proxy_jump is not None:
        jump = connect(target.proxy_jump, accept_new_host_key=accept_new)
        jumps.append(jump)
        try:
            return jump.transport.open_channel(
                "direct-tcpip",
                (target.hostname, target.port),
                ("127.0.0.1", 0),
                timeout=target.connect_timeout,
            )
        except (paramiko.SSHException, OSError) as exc:
            raise ConnectionFailed(
                f"Jump host {target.proxy_jump.description} could not reach "
                f"{target.hostname}:{target.port}: {exc or type(exc).__name__}"
            ) from None
    if target.proxy_command is not None:
        try:
            return _proxy_command(target)
        except paramiko.ProxyCommandFailure as exc:
            raise ConnectionFailed(f"ProxyCommand for {target.alias} failed: {exc}") from None
    where = (target.hostname, target.port)
    try:
        return socket.create_connection(where, timeout=target.connect_timeout)
    except ConnectionResetError as exc:  # accepted, then reset before we could read
        raise ConnectionDropped(
            f"{target.hostname}:{target.port} closed the connection before saying anything "
            f"({exc.strerror or exc})"
        ) from None
    except OSError as exc:
        why = exc.strerror or str(exc) or type(exc).__name__
        raise ConnectionFailed(
            f"Cannot connect to {target.hostname}:{target.port}: {why}"
        ) from None


def connect(target: SSHTarget, *, accept_new_host_key: bool = False) -> Connection:
    """Open and authenticate one connection to `target` (through its proxy, if any)."""
    jumps: list[Connection] = []
    client = paramiko.SSHClient()
    sock: _Watched | None = None
    try:
        sock = _socket(target, jumps, accept_new_host_key)
        entries = known_hosts.load(target.system_known_hosts_files + target.known_hosts_files)
        client.set_missing_host_key_policy(
            _HostKeyPolicy(target, entries, accept_new=accept_new_host_key)
        )
        _open(client, target, sock, known_hosts.known_types(entries, target.known_hosts_name))
    except BaseException as exc:
        if isinstance(exc, ConnectionFailed):
            exc.hint = by_hand(exc.hint, target)
        client.close()
        if sock is not None:  # a ProxyCommand process ends with it
            with contextlib.suppress(Exception):
                sock.close()
        for jump in jumps:
            jump.close()
        raise
    connection = Connection(client=client, jumps=jumps)
    watched = sock
    assert watched is not None
    connection.watchdog = Watchdog(
        connection.transport,
        lambda: watched.last_received,
        target.alive,
        where=target.description,
    )
    connection.watchdog.start()
    return connection


def _transport_factory(known_types: list[str]) -> Any:
    """A Transport that offers the host key types known_hosts records for the host first."""

    def make(sock: Any, **kwargs: Any) -> paramiko.Transport:
        transport = paramiko.Transport(sock, **kwargs)
        options = transport.get_security_options()
        first = [a for t in known_types for a in _ALGORITHMS.get(t, (t,))]
        first = [a for a in first if a in options.key_types]
        options.key_types = first + [a for a in options.key_types if a not in first]
        return transport

    return make


class _ServerWords(logging.Handler):
    """What the server said when it disconnected: paramiko only logs it (at INFO), and it is
    what tells "too many authentication failures" from a server that went away."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("Disconnect (code"):
            self.said.append(text.partition(": ")[2])


@contextlib.contextmanager
def _listening(client: paramiko.SSHClient, target: SSHTarget) -> Iterator[_ServerWords]:
    """Hear the transport's log during the handshake only; afterwards its records go where
    paramiko's always go (nowhere, in the CLI, unless --verbose)."""
    channel = f"paramiko.transport.dflash.{target.hostname}:{target.port}"
    client.set_log_channel(channel)
    logger, words = logging.getLogger(channel), _ServerWords()
    logger.setLevel(min(logging.INFO, logging.getLogger("paramiko").getEffectiveLevel()))
    logger.addHandler(words)
    try:
        yield words
    finally:
        logger.removeHandler(words)
        logger.setLevel(logging.NOTSET)


def _open(
    client: paramiko.SSHClient, target: SSHTarget, sock: _Watched, known_types: list[str]
) -> None:
    key_files = [str(p) for p in target.identity_files if p.is_file()]
    use_agent = not target.identities_only and bool(os.environ.get("SSH_AUTH_SOCK"))
    with _listening(client, target) as words:
        _handshake(client, target, sock, known_types, words, (key_files, use_agent))


def _handshake(
    client: paramiko.SSHClient,
    target: SSHTarget,
    sock: _Watched,
    known_types: list[str],
    words: _ServerWords,
    offered: tuple[list[str], bool],
) -> None:
    key_files, use_agent = offered
    try:
        client.connect(
            target.hostname,
            port=target.port,
            username=target.user,
            # paramiko takes a list of files too; its stubs say only `str`
            key_filename=key_files or None,  # type: ignore[arg-type]
            allow_agent=use_agent,
            look_for_keys=False,  # the default keys are in identity_files already, as in ssh
            timeout=target.connect_timeout,
            banner_timeout=target.connect_timeout,
            auth_timeout=target.connect_timeout,
            # paramiko takes any socket-like object; its stubs list only concrete classes
            sock=sock,  # type: ignore[arg-type]
            transport_factory=_transport_factory(known_types),
        )
    except (HostKeyUnknown, HostKeyChanged, HostKeyRevoked):
        raise
    except Exception as exc:
        raise _failure(client, target, exc, sock, words.said, offered) from None


def _failure(
    client: paramiko.SSHClient,
    target: SSHTarget,
    exc: Exception,
    sock: _Watched,
    said: list[str],
    offered: tuple[list[str], bool],
) -> ConnectionFailed:
    """The one error that says what went wrong (see the module docstring)."""
    where = f"{target.hostname}:{target.port}"
    transport = client.get_transport()
    reason = str(exc) or type(exc).__name__
    received = sock.received
    if said:  # the server ended it on purpose and said why
        return _refused(target, said[-1], offered)
    if isinstance(exc, TimeoutError) or "timed out" in reason:
        if received and "protocol banner" in reason:
            return NotAnSSHServer(f"{where} answered, but not as an SSH server ({reason})")
        return ConnectionFailed(f"Cannot connect to {where}: timed out ({reason})")
    if "protocol banner" in reason and received and not (sock.spoke_ssh and _peer_closed(reason)):
        return NotAnSSHServer(f"{where} answered, but not as an SSH server ({reason})")
    if sock.silent_for(0.9 * target.connect_timeout):  # paramiko's banner wait ran out
        return ConnectionFailed(
            f"{where} accepted the connection but did not answer: no SSH banner within "
            f"{target.connect_timeout:g} s",
            hint="Something holds that port without speaking (a hung sshd, a firewall or "
            "another service): check the port (--port, Port in ~/.ssh/config), then try it by "
            "hand: ssh -v <host> true",
        )
    if (
        "protocol banner" in reason
        or isinstance(exc, EOFError | ConnectionError)
        or _peer_closed(reason)
        or transport is None
        or not transport.is_active()
    ):
        when = "during the SSH handshake" if received else "before saying anything"
        return ConnectionDropped(f"{where} closed the connection {when} ({_dropped(exc)})")
    if "Authentication timeout" in reason:  # paramiko's: the server went silent, no refusal
        return ConnectionDropped(
            f"{where} stopped answering during the SSH handshake (no answer to the "
            f"authentication within ConnectTimeout, {target.connect_timeout:g} s)"
        )
    key_files, use_agent = offered
    if isinstance(exc, paramiko.PasswordRequiredException):
        return AuthenticationFailed(
            f"{target.user}@{where}: a key file is protected by a passphrase",
            hint="Load the key into ssh-agent (ssh-add <key>) and run again.",
        )
    if isinstance(exc, paramiko.AuthenticationException):
        tried = ", ".join(key_files) or "no key files"
        agent = " and the SSH agent" if use_agent else ""
        return AuthenticationFailed(
            f"{target.user}@{where} refused every key offered ({tried}{agent})"
        )
    if "No authentication methods available" in reason:
        return AuthenticationFailed(
            f"{target.user}@{where}: no key to offer (no IdentityFile found and no SSH agent)"
        )
    return ConnectionFailed(f"Cannot connect to {where}: {reason}")


def _refused(target: SSHTarget, said: str, offered: tuple[list[str], bool]) -> ConnectionFailed:
    where = f"{target.hostname}:{target.port}"
    if "authentication" in said.lower():
        tried = ", ".join(offered[0]) or "no key files"
        agent = " and the SSH agent" if offered[1] else ""
        return AuthenticationFailed(
            f"{target.user}@{where} refused every key offered ({tried}{agent}): "
            f"the server said {said!r}"
        )
    return ConnectionDropped(f"{where} ended the connection: the server said {said!r}")


def _peer_closed(reason: str) -> bool:
    return any(
        text in reason
        for text in ("Connection reset", "Broken pipe", "closed by", "EOF", "No existing session")
    )


def _dropped(exc: Exception) -> str:
    text = str(exc)
    if not text or "transport shut down or saw EOF" in text or text == "EOFError":
        return "the server closed it"
    return text
