"""Notice a dead peer in bounded time, as OpenSSH's ServerAliveInterval/ServerAliveCountMax do.

A link that drops packets without a reset (a pulled cable, a firewall, a suspended VM) leaves
TCP retransmitting for many minutes, and paramiko notices nothing: its own
`Transport.set_keepalive` sends `keepalive@lag.net` without asking for a reply, and only after a
pause in what *we* send. It keeps a NAT mapping open; it never learns that the peer is gone.

`Watchdog` watches what the connection *receives* (every byte read from its socket, timed by
`ssh_connect`). After `interval` seconds without a byte it sends a `keepalive@openssh.com`
global request that wants a reply, which the SSH server itself answers (a failure message, from
sshd, whatever the remote command is doing: an upload, a silent check, a wait). Once
`count_max` such probes went unanswered and `interval` more seconds passed, the connection is
declared dead and closed: every command on it then fails at once, and `dead` says why, instead
of hanging until the link comes back. That is OpenSSH's own rule (`server_alive_check`: the
`count_max + 1`-th silent interval ends the connection), so a dead peer is declared at most
`bound` seconds after the last byte came.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import paramiko

DEFAULT_INTERVAL = 5.0  # ServerAliveInterval 0 (OpenSSH's default: off) means this
DEFAULT_COUNT_MAX = 3  # OpenSSH's default ServerAliveCountMax
PROBE = "keepalive@openssh.com"


@dataclass(frozen=True)
class AliveSettings:
    """ServerAliveInterval (seconds, > 0) and ServerAliveCountMax (≥ 0) of one connection."""

    interval: float = DEFAULT_INTERVAL
    count_max: int = DEFAULT_COUNT_MAX

    @classmethod
    def of(cls, interval: float, count_max: int) -> AliveSettings:
        """The settings as `ssh -G` prints them; an interval of 0 (off) is `DEFAULT_INTERVAL`:
        dflash always watches, since a command that hangs silently is worse than one that
        fails."""
        return cls(interval if interval > 0 else DEFAULT_INTERVAL, max(count_max, 0))

    @property
    def bound(self) -> float:
        """Seconds from the last byte received to the verdict on a dead peer."""
        return self.interval * (self.count_max + 1)

    def describe(self) -> str:
        return f"ServerAliveInterval {self.interval:g} s, ServerAliveCountMax {self.count_max}"


class Watchdog:
    """Probes a quiet connection and closes it once the peer stopped answering (`dead`).

    `last_received()` is the `time.monotonic()` of the last byte read from the connection's
    socket. The watchdog's thread ends with the connection (or `stop`)."""

    def __init__(
        self,
        transport: paramiko.Transport,
        last_received: Callable[[], float],
        settings: AliveSettings,
        *,
        where: str,
    ) -> None:
        self.settings = settings
        self.dead: str | None = None  # why the connection was declared dead
        self._transport = transport
        self._last_received = last_received
        self._where = where
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name=f"alive {where}")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _watch(self) -> None:
        interval, probes = self.settings.interval, 0
        heard = self._last_received()
        due = heard + interval
        while not self._stopped.wait(max(due - time.monotonic(), 0.0)):
            if not self._transport.is_active():
                return
            last = self._last_received()
            if last != heard:  # the peer said something: it lives
                heard, probes, due = last, 0, last + interval
                continue
            now = time.monotonic()
            if now < due:
                continue
            if probes >= self.settings.count_max:
                self._declare(now - heard, probes)
                return
            self._probe()
            probes += 1
            due = now + interval

    def _probe(self) -> None:
        """One probe in a thread of its own: sending can block behind a full socket buffer
        (an upload into a dead link), and the verdict must not wait for it."""
        threading.Thread(target=self._ask, daemon=True, name=f"probe {self._where}").start()

    def _ask(self) -> None:
        # Returns with the answer, or when the transport closes; any failure is the verdict's
        # business, not this thread's.
        with contextlib.suppress(Exception):
            self._transport.global_request(PROBE, wait=True)

    def _declare(self, silence: float, probes: int) -> None:
        self.dead = (
            f"no answer from {self._where} for {silence:.0f} s ({probes} keepalive probes "
            f"unanswered; {self.settings.describe()})"
        )
        with contextlib.suppress(Exception):
            self._transport.close()  # every command on it fails now, rather than hangs
