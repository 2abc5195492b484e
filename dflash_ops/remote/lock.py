"""The deploy lock of a target: one changing command (deploy, restart, stop, rollback) at a time.

The lock is a symlink `<root>/deploy.lock` whose *target text* is the owner record (JSON: who,
from which host, which process, since when, doing what). `ln -sT OWNER PATH` is one `symlink()`
call: it either creates the link with its content or fails because it exists, so taking the lock
and saying who holds it are one atomic step — through ssh and `pct exec` alike, with no window
in which a lock exists without an owner. `readlink` reads the owner back.

Who holds it. A command that changes the place runs as ONE remote program (`remote/site.sh`,
step `lock`), which takes the lock itself and writes into the record its own identity at the
place: its pid, the kernel's boot id and the process's start time (`/proc/PID/stat`, field 22),
beside the operator's user, host and CLI pid (for messages). That program ends when its connection does, so
the lock is stale exactly when that process is gone — checked at the place, where pids live: a
pid reused by another process has another start time and does not count as the holder. Such a
lock is taken over with a warning, inside the next run of the program, only if it still holds
the record judged stale.

Records without a place identity (written by an older dflash, or by hand) are stale when their
host is this machine and the CLI pid is gone, or when older than `[job] lock_max_age` (default 6 h, by this machine's clock).

`--force` takes over any lock (with a warning naming the holder). A live holder makes the
command wait `[job] lock_wait` seconds, then fail with `LockHeld` naming the holder.

Taking over renames the link aside (an atomic rename: of two commands taking over at once,
only one moves it) and checks that what it moved is the record it judged; if a fresh lock was
moved instead, it is put back. The lock is then taken the normal way, with `ln -sT`.
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dflash_ops.connect import shell
from dflash_ops.errors import LockHeld

if TYPE_CHECKING:
    from dflash_ops.connect.place import Place

log = logging.getLogger(__name__)

LOCK_NAME = "deploy.lock"


@dataclass(frozen=True, kw_only=True)
class Owner:
    """Who holds a lock. `host` + `pid` identify the CLI process on the operator's machine."""

    by: str  # user@host
    host: str
    pid: int
    since: float  # seconds since the epoch, the holder's clock
    doing: str  # "deploy", "restart", …
    token: str  # makes every record unique
    # The holding program at the place (written there by site.sh's `lock_record`): its pid and
    # "BOOT_ID START_TICKS". None in a record written by an older dflash or by hand.
    place_pid: int | None = None
    place_start: str | None = None

    @classmethod
    def me(cls, doing: str) -> Owner:
        host = socket.gethostname()
        return cls(
            by=f"{getpass.getuser()}@{host}",
            host=host,
            pid=os.getpid(),
            since=time.time(),
            doing=doing,
            token=secrets.token_hex(4),
        )

    def text(self) -> str:
        fields = {k: v for k, v in asdict(self).items() if v is not None}
        return json.dumps(fields, separators=(",", ":"), sort_keys=True)

    @classmethod
    def parse(cls, text: str) -> Owner | None:
        try:
            data: Any = json.loads(text)
            return cls(
                by=str(data["by"]),
                host=str(data["host"]),
                pid=int(data["pid"]),
                since=float(data["since"]),
                doing=str(data["doing"]),
                token=str(data["token"]),
                place_pid=_optional(data.get("place_pid"), int),
                place_start=_optional(data.get("place_start"), str),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self, *, now: float | None = None) -> str:
        age = max(0.0, (now or time.time()) - self.since)
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(self.since))
        there = "" if self.place_pid is None else f", its script pid {self.place_pid} at the place"
        return f"{self.doing} by {self.by} (pid {self.pid}{there}) since {since}, {age:.0f} s ago"

    def stale_reason(
        self, *, max_age: float, now: float | None = None, holder: str | None = None
    ) -> str | None:
        """Why this lock's holder is gone, or None while it may still be working.

        `holder`: what the place said of the program named in the record (site.sh's `lock_holder`:
        "alive", "gone", "unknown"); it decides alone when the record names that script.
        """
        if self.place_pid is not None and holder in ("alive", "gone"):
            if holder == "alive":
                return None
            return f"its script (pid {self.place_pid} at the place) has ended"
        age = (now or time.time()) - self.since
        if age > max_age:
            return f"it is {age:.0f} s old (more than job.lock_max_age = {max_age:.0f} s)"
        if self.host == socket.gethostname() and not _alive(self.pid):
            return f"its process {self.pid} on {self.host} no longer exists"
        return None


def _optional(value: Any, kind: Callable[[Any], Any]) -> Any:
    return None if value is None else kind(value)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class DeployLock:
    """The lock at `<root>/deploy.lock` on `place`."""

    def __init__(
        self,
        place: Place,
        root: str,
        *,
        wait: float = 10.0,
        max_age: float = 6 * 3600.0,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.place = place
        self.root = shell.remote_path(root)
        self.path = f"{self.root}/{LOCK_NAME}"
        self.wait = wait
        self.max_age = max_age
        self.warn = warn or (lambda message: log.warning("%s", message))

    def judge(
        self, held: str, *, force: bool, deadline: float, holder: str | None = None
    ) -> str | None:
        """The record to take over (after a warning), or None after a short wait for a live
        holder; `LockHeld` naming the holder once `deadline` (time.monotonic) has passed.
        `holder`: what the place said of the script the record names (`Owner.stale_reason`)."""
        record = Owner.parse(held)
        shown = record.describe() if record else f"an unreadable record {held!r}"
        reason = record.stale_reason(max_age=self.max_age, holder=holder) if record else None
        if force or reason:
            why = "--force" if force else f"the lock is stale: {reason}"
            self.warn(f"Taking over the deploy lock at {self.path} ({why}); it was {shown}.")
            return held
        if time.monotonic() >= deadline:
            raise LockHeld(
                f"The deploy lock at {self.path} on {self.place.description} is held: "
                f"{shown}. Waited {self.wait:g} s.",
                hint=(
                    "Wait for that command to finish and run again. If its holder is gone "
                    "(crashed on another machine), pass --force."
                ),
            )
        time.sleep(min(0.3, max(0.0, deadline - time.monotonic())))
        return None
