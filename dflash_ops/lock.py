"""The deploy lock of a target: one changing command (deploy, restart, stop, rollback) at a time.

The lock is a symlink `<root>/deploy.lock` whose *target text* is the owner record (JSON: who,
from which host, which process, since when, doing what). `ln -sT OWNER PATH` is one `symlink()`
call: it either creates the link with its content or fails because it exists, so taking the lock
and saying who holds it are one atomic step — through ssh and `pct exec` alike, with no window
in which a lock exists without an owner. `readlink` reads the owner back.

Who holds it. A command that changes the place runs as ONE remote script (`deploy_script`),
which takes the lock itself and writes into the record its own identity at the place: its pid,
the kernel's boot id and the process's start time (`/proc/PID/stat`, field 22), beside the
operator's user, host and CLI pid (for messages). That script ends when its connection does, so
the lock is stale exactly when that process is gone — checked at the place, where pids live: a
pid reused by another process has another start time and does not count as the holder. Such a
lock is taken over with a warning, inside the next script, only if it still holds the record
judged stale.

Records without a place identity (taken by `DeployLock.acquire`, a separate command) are judged
as before: stale when their host is this machine and the CLI pid is gone, or when older than
`[job] lock_max_age` (default 6 h, by this machine's clock).

`--force` takes over any lock (with a warning naming the holder). A live holder makes the
command wait `[job] lock_wait` seconds, then fail with `LockHeld` naming the holder.

Taking over renames the link aside (an atomic rename: of two commands taking over at once,
only one moves it) and checks that what it moved is the record it judged; if a fresh lock was
moved instead, it is put back. The lock is then taken the normal way, with `ln -sT`.
"""

from __future__ import annotations

import contextlib
import getpass
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from dflash_ops import shell
from dflash_ops.errors import LockHeld, RemoteCommandFailed

if TYPE_CHECKING:
    from dflash_ops.place import Place

log = logging.getLogger(__name__)

LOCK_NAME = "deploy.lock"
HELD = 3  # exit status of the functions below when someone else holds the lock

# The lock's steps as bash functions, values as positional arguments. `DeployLock` runs each as
# one command; `dflash deploy` runs the same text inside its one command (`deploy_script`).
FUNCTIONS = r"""
dflash_lock_take() {  # $1 root, $2 lock path, $3 owner text. 0: taken; 3: held (stdout: record)
  local n=0
  mkdir -p -- "$1" || return 1
  while [ "$n" -lt 20 ]; do
    if ln -sT -- "$3" "$2" 2>/dev/null; then return 0; fi
    if readlink -- "$2"; then return 3; fi
    n=$((n + 1))  # it vanished between ln and readlink: try again
  done
  echo "cannot create the lock $2" >&2
  return 1
}
dflash_lock_take_over() {  # $1 lock path, $2 the stale record, $3 a token. 3: it changed
  local aside="$1.stale.$3" moved
  mv -T -- "$1" "$aside" 2>/dev/null || return 3
  moved=$(readlink -- "$aside") || moved=""
  if [ "$moved" = "$2" ]; then rm -f -- "$aside"; return 0; fi
  ln -sT -- "$moved" "$1" 2>/dev/null
  rm -f -- "$aside"
  return 3
}
dflash_lock_release() {  # $1 lock path, $2 our record: removes the lock only if it is still ours
  if [ "$(readlink -- "$1")" = "$2" ]; then rm -f -- "$1"; fi
}
dflash_lock_is_mine() {  # $1 lock path, $2 our record: 0 when the lock holds our record
  [ "$(readlink -- "$1" 2>/dev/null)" = "$2" ]
}
dflash_proc_start() {  # $1 a pid: "BOOT_ID START_TICKS" of that process; fails when none (or a zombie)
  local s boot
  { read -r s < "/proc/$1/stat"; } 2>/dev/null || return 1
  { read -r boot < /proc/sys/kernel/random/boot_id; } 2>/dev/null || boot=-
  s=${s##*) }
  # shellcheck disable=SC2086  # split into the stat fields (state, ppid, pgrp, ...)
  set -- $s
  [ "$1" != Z ] || return 1
  printf '%s %s\n' "$boot" "${20}"
}
dflash_lock_record() {  # $1 the operator's record (JSON), $2 our pid: the record naming us
  local start
  start=$(dflash_proc_start "$2") || return 1
  printf '%s,"place_pid":%s,"place_start":"%s"}\n' "${1%\}}" "$2" "$start"
}
dflash_lock_holder() {  # $1 a lock record: alive, gone, or unknown (no place identity in it)
  local re='"place_pid":([0-9]+),"place_start":"([^"]*)"' pid want
  [[ $1 =~ $re ]] || { echo unknown; return 0; }
  pid=${BASH_REMATCH[1]} want=${BASH_REMATCH[2]}
  if [ "$(dflash_proc_start "$pid")" = "$want" ]; then echo alive; else echo gone; fi
}
"""
_TAKE = FUNCTIONS + 'dflash_lock_take "$@"\n'
_TAKE_OVER = FUNCTIONS + 'dflash_lock_take_over "$@"\n'
_RELEASE = FUNCTIONS + 'dflash_lock_release "$@"\n'


@dataclass(frozen=True, kw_only=True)
class Owner:
    """Who holds a lock. `host` + `pid` identify the CLI process on the operator's machine."""

    by: str  # user@host
    host: str
    pid: int
    since: float  # seconds since the epoch, the holder's clock
    doing: str  # "deploy", "restart", …
    token: str  # makes every record unique
    # The holding script at the place (written there, by `dflash_lock_record`): its pid and
    # "BOOT_ID START_TICKS". None in a record taken by a separate command.
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

        `holder`: what the place said of the script named in the record (`dflash_lock_holder`:
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

    def holder(self) -> str | None:
        """The raw record of the current holder, or None when the lock is free."""
        result = self.place.run(["readlink", "--", self.path], check=False)
        return result.stdout_text.rstrip("\n") if result.exit_code == 0 else None

    @contextlib.contextmanager
    def held(self, doing: str, *, force: bool = False) -> Iterator[Owner]:
        owner = self.acquire(doing, force=force)
        try:
            yield owner
        finally:
            self.release(owner)

    def acquire(self, doing: str, *, force: bool = False, held_by: str | None = None) -> Owner:
        """Take the lock: wait for a live holder, take over a stale one (or any, with `force`).

        `held_by`: the holder's record that a first attempt made elsewhere found (`dflash
        deploy` tries to take the lock inside its one command); it is judged before trying again.
        """
        owner = Owner.me(doing)
        deadline = time.monotonic() + self.wait
        while True:
            held = held_by if held_by is not None else self._try(owner)
            held_by = None
            if held is None:
                log.info("took the deploy lock", extra={"path": self.path, "doing": doing})
                return owner
            stale = self.judge(held, force=force, deadline=deadline)
            if stale is not None:
                self._take_over(stale)

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

    def release(self, owner: Owner) -> None:
        try:
            self.place.run(["bash", "-c", _RELEASE, "dflash-unlock", self.path, owner.text()])
        except Exception as exc:  # noqa: BLE001 - a failed release must not hide the real error
            self.warn(f"Could not remove the deploy lock {self.path}: {exc}")

    def _try(self, owner: Owner) -> str | None:
        """Take the lock; None when taken, else the holder's record."""
        result = self.place.run(
            ["bash", "-c", _TAKE, "dflash-lock", self.root, self.path, owner.text()],
            check=False,
        )
        if result.exit_code == 0:
            return None
        if result.exit_code == HELD:
            return result.stdout_text.rstrip("\n")
        raise RemoteCommandFailed(
            self.place.description, result.argv, result.exit_code, result.stderr_text
        )

    def _take_over(self, record: str) -> None:
        self.place.run(
            ["bash", "-c", _TAKE_OVER, "dflash-takeover", self.path, record, secrets.token_hex(4)],
            check=False,
        )
