"""One training job: a detached tmux session on a private socket at a place.

The session runs one argv with the job's environment; stdout and stderr are appended to the log
file and the pane is kept after the process exits (`remain-on-exit on`), so the exit status can
still be read (`#{pane_dead_status}`). Starting and stopping are steps of the site program
(`remote/site.sh`: `job_start`, `job_stop`), run by deploy, restart, rollback and stop inside
their one command; this module gives them their arguments (`start_args`, `stop_ticks`) and reads
their answer (`parse_line`, `start_failed`). Reading the state runs the same tmux argv through
the place, bounded like every command there (its time and what it may print: a tmux that hangs
or floods is the place's fault, never a hung or bloated dflash).

Nothing here knows what the command is: the release layer decides that.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from dflash_ops.connect import shell
from dflash_ops.errors import ConnectionFailed, DflashError, JobRunning
from dflash_ops.untrusted import clip, last_line

if TYPE_CHECKING:
    from dflash_ops.connect.place import Place

log = logging.getLogger(__name__)

# The pane's first program is a placeholder: remain-on-exit must be on before the real command
# can exit, so the job is started by `respawn-pane -k` in the same tmux invocation.
_PLACEHOLDER = ("sleep", "2147483647")

# A constant script: the log path and the folder come from the environment, the job's argv from
# "$@", so no value is ever interpolated into shell text.
# stdin stays on the pane's terminal: tmux takes a pane whose terminal nobody holds open for
# dead, closes it, and the job would then get SIGHUP.
WRAPPER = 'exec >>"$DFLASH_LOG" 2>&1 || exit 125\ncd -- "$DFLASH_CWD" || exit 126\nexec "$@"\n'

_FORMAT = (
    "#{pane_dead}|#{pane_dead_status}|#{pane_dead_signal}|#{pane_pid}|#{session_created}|#{pid}"
)
RUNNING = 5  # site.sh: the job's session is running, the start is refused

# Streams the log from byte $1 while process $2 lives (a zombie counts as gone), polling every
# $4 s. Whatever is written after the end is read by the caller from the byte offset.
_FOLLOW = (
    'tail -c "+$1" -F -s "$4" -- "$3" 2>/dev/null & t=$!\n'
    "trap 'kill \"$t\" 2>/dev/null' EXIT\n"
    'while kill -0 "$t" 2>/dev/null && s=$(cat "/proc/$2/stat" 2>/dev/null); do\n'
    '  s=${s##*) }; [ "${s%% *}" = Z ] && break\n'
    '  sleep "$4"\n'
    "done\n"
)

# Prints the log's size and the bytes before its last $3, then its last $2 lines among those
# bytes, up to that size (so a follower can resume from exactly the byte after what was
# printed). `tail -c +N` seeks: a log of any size costs $3 bytes at most.
_SIZE_AND_TAIL = (
    's=$(stat -c %s -- "$1" 2>/dev/null) || { echo -1 0; exit 0; }\n'
    "b=$(( s > $3 ? s - $3 : 0 ))\n"
    'echo "$s $b"\n'
    'tail -c "+$((b + 1))" -- "$1" | head -c "$((s - b))" | tail -n "$2"\n'
)

_MISSING = ("can't find session", "no server running", "error connecting", "can't find window")
_NOT_CLOSED = "tmux did not close the job session"  # site.sh's `job_end`, after five kills
_HUNG = "` did not answer within "  # site.sh's `tmux`, past --tool-timeout
TMUX_CAP = 64 * 1024  # bytes of a tmux answer kept (a pane's state line is under 100)


LOG_CAP = 1024 * 1024  # bytes of the log's end `tail` reads (`dflash logs` without --follow)


@dataclass(frozen=True, kw_only=True)
class LogTail:
    """The log's last lines: `body`, the log's size they end at (`size`, -1: no log yet), and
    how many bytes of the log lie before them when the first of them was cut to the bound
    (`cut`, else 0)."""

    body: bytes
    size: int
    cut: int = 0


@dataclass(frozen=True, kw_only=True)
class StartUp:
    """How a job's start-up went, as site.sh's `ready` step saw it: `ready` (its readiness
    line, or its first line), `ended` (with its state and the log's last lines), `starting`
    (neither within the wait) or `interrupted` (the caller let go during the wait)."""

    outcome: Literal["ready", "ended", "starting", "interrupted"]
    state: JobState | None = None
    lines: tuple[str, ...] = ()


@dataclass(frozen=True)
class TmuxResult:
    exit_code: int
    stdout: str
    stderr: str


@dataclass(frozen=True, kw_only=True)
class JobState:
    """What tmux knows about the job's session."""

    session: str
    exists: bool  # the session is there (running, or dead pane kept for its status)
    running: bool
    exit_code: int | None  # once exited: the status, or 128 + signal
    pid: int | None  # the pane's process: the leader of the job's process group
    started_at: float | None  # epoch seconds


def socket_for(root: str) -> str:
    """The default tmux socket of the target whose root folder is `root`: `dflash-<8 hex>`.

    One tmux server per root, so two projects at one place (two folders on this machine, two
    roots on one host) never see, stop or replace each other's job; the same root — the same
    releases and `current` — always finds its own job again.
    """
    return "dflash-" + hashlib.sha256(root.encode("utf-8", "surrogateescape")).hexdigest()[:8]


def tmux_arg(value: str) -> str:
    """Protect one argument from tmux's own command-line parsing.

    tmux splits its arguments into commands at any argument that *ends* with ';' — even after
    `--` — so an env value or argv element like "x;" would start a new tmux command. tmux reads
    a trailing "\\;" back as a literal ';'.
    """
    return value[:-1] + "\\;" if value.endswith(";") else value


class Job:
    """The job's tmux session `session` on socket `socket` at `place`, logging to `log`."""

    def __init__(
        self,
        place: Place,
        *,
        session: str,
        log: str,
        socket: str = "dflash",
        stop_timeout: float = 30.0,
    ) -> None:
        self.place = place
        self.session = shell.session_name(session)
        self.socket = shell.session_name(socket)
        self.log = log
        self.stop_timeout = stop_timeout

    # tmux -------------------------------------------------------------------------------

    def attach_argv(self) -> list[str]:
        """`tmux -L SOCKET attach-session -t =SESSION`: the argv that puts the job's pane on a
        terminal (run there by `dflash attach`, not through the place)."""
        return ["tmux", "-L", self.socket, "attach-session", "-t", f"={self.session}"]

    def tmux(self, *args: str) -> TmuxResult:
        """`tmux -L <socket> ARGS…` at the place."""
        args = tuple(a if a == ";" else tmux_arg(a) for a in args)
        # Only the subcommands: arguments may hold env values, which may be secrets.
        commands = [args[0], *(args[i + 1] for i, a in enumerate(args[:-1]) if a == ";")]
        log.debug("tmux -L %s %s on %s", self.socket, " ; ".join(commands), self.place.description)
        result = self.place.run(["tmux", "-L", self.socket, *args], check=False, cap=TMUX_CAP)
        if result.exit_code == 127:
            raise _tmux_missing(self.place.description)
        return TmuxResult(result.exit_code, result.stdout_text, result.stderr_text)

    def _check(self, result: TmuxResult, what: str) -> TmuxResult:
        if result.exit_code != 0:
            raise DflashError(
                f"tmux could not {what} for session {self.session!r} on "
                f"{self.place.description}: {last_line(result.stderr)}",
                hint=f"Look at the session by hand: tmux -L {self.socket} ls",
            )
        return result

    # lifecycle --------------------------------------------------------------------------

    def state(self) -> JobState:
        """`tmux list-panes -t =SESSION: -F '#{pane_dead}|…'`: running, exited (with status), or gone."""
        current, server_pid, dead = self._read_state()
        if dead and current.running and server_pid is not None:
            # The pane's terminal is closed but no exit status yet. tmux 3.3 sometimes misses
            # the SIGCHLD of a pane process (seen on 3.3a: the process stays a zombie until the
            # next one); another SIGCHLD makes it reap and record the status.
            nudge = ["bash", "-c", 'kill -s CHLD "$1"', "dflash-nudge", str(server_pid)]
            self.place.run(nudge, check=False)
            for _ in range(10):
                current, _, _ = self._read_state()
                if not current.running:
                    break
                time.sleep(0.02)
        return current

    def _read_state(self) -> tuple[JobState, int | None, bool]:
        return self._parse_state(self.tmux(*self._list_panes()))

    def _list_panes(self) -> tuple[str, ...]:
        return ("list-panes", "-t", f"={self.session}:", "-F", _FORMAT)

    def _parse_state(self, result: TmuxResult) -> tuple[JobState, int | None, bool]:
        if result.exit_code != 0:
            if any(m in result.stderr for m in _MISSING) or not result.stderr.strip():
                gone = JobState(
                    session=self.session,
                    exists=False,
                    running=False,
                    exit_code=None,
                    pid=None,
                    started_at=None,
                )
                return gone, None, False
            self._check(result, "read the session")
        line = (result.stdout.splitlines() or [""])[0]
        fields = (line.split("|") + [""] * 6)[:6]
        if not all(f.isascii() and (f.isdigit() or not f) for f in fields):
            raise DflashError(
                f"tmux answered something else than the state of session {self.session!r} on "
                f"{self.place.description}: {clip(line)}",
                hint=f"Look at the session by hand: tmux -L {self.socket} ls",
            )
        dead, status, signal, pid, created, server = fields
        # tmux marks the pane dead when its terminal closes and records the status when it
        # reaps the process, a moment apart (and a process that left the job's group can hold
        # the terminal open after the job): the job has ended once the status is known.
        exit_code: int | None = None
        if status.isdigit():
            exit_code = int(status)
        elif signal.isdigit():
            exit_code = 128 + int(signal)
        state = JobState(
            session=self.session,
            exists=True,
            running=exit_code is None,
            exit_code=exit_code,
            pid=int(pid) if pid else None,
            started_at=float(created) if created else None,
        )
        return state, int(server) if server.isdigit() else None, dead == "1"

    def start_args(self, argv: Sequence[str], *, cwd: str, env: Mapping[str, str]) -> list[str]:
        """tmux's arguments that start `argv` in `cwd` with `env` (site.sh's `job_start` runs
        them after `--`): one tmux invocation, `new-session -d -s S sleep… ; set-option -w -t
        =S: remain-on-exit on ; respawn-pane -k -t =S: -e K=V… -- bash -c WRAPPER dflash-job
        ARGV… ; list-panes …`."""
        if not argv:
            raise DflashError("Refusing to start an empty command.")
        job_env = {shell.env_key(k): shell.env_value(v) for k, v in env.items()}
        job_env["DFLASH_LOG"] = shell.env_value(self.log)
        job_env["DFLASH_CWD"] = shell.env_value(cwd)
        env_args = [arg for k, v in job_env.items() for arg in ("-e", f"{k}={v}")]
        target = f"={self.session}:"
        start = (
            "new-session", "-d", "-s", self.session, "-x", "200", "-y", "50", *_PLACEHOLDER,
            ";", "set-option", "-w", "-t", target, "remain-on-exit", "on",
            ";", "respawn-pane", "-k", "-t", target, *env_args,
            "--", "bash", "-c", WRAPPER, "dflash-job", *argv,
            ";", *self._list_panes(),
        )  # fmt: skip
        return [a if a == ";" else tmux_arg(a) for a in start]

    def start_failed(self, exit_code: int, stderr: str) -> DflashError:
        """What site.sh's `job_start` exit says: running, tmux missing, or tmux's error."""
        if exit_code == RUNNING:
            return JobRunning(
                f"Job session {self.session!r} is already running on {self.place.description}.",
            )
        if exit_code == 127:
            return self.tmux_missing()
        try:
            self._check(TmuxResult(exit_code, "", stderr), "start the job")
        except DflashError as exc:
            return exc
        return DflashError(f"tmux could not start the job (exit {exit_code}).")

    def tmux_missing(self) -> DflashError:
        return _tmux_missing(self.place.description)

    def stop_failed(self, exit_code: int, stderr: str) -> DflashError | None:
        """What site.sh's `job_stop` exit says: tmux missing, or a session tmux did not close
        after the job stopped (None: the caller quotes the error)."""
        if exit_code == 127:
            return self.tmux_missing()
        if _HUNG in stderr:
            return DflashError(
                f"Could not stop the job on {self.place.description}: "
                f"{last_line(stderr)}; nothing was switched, archived or started.",
                hint=f"tmux hangs there: look at it (tmux -L {self.socket} ls), end the hung "
                "tmux processes, then run the command again.",
            )
        if _NOT_CLOSED not in stderr:
            return None
        return DflashError(
            f"The job on {self.place.description} was stopped, but tmux did not close its "
            f"session {self.session!r}; nothing was archived or started.",
            hint=f"Look at it: tmux -L {self.socket} ls; end it by hand (tmux -L {self.socket} "
            f"kill-session -t {self.session}), then run the command again.",
        )

    def _stop_waits(self, timeout: float | None, save: bool = True) -> tuple[float, float, float]:
        """Seconds to wait after SIGINT (`stop_timeout`; none without `save`), SIGTERM (at most
        10) and SIGKILL (5)."""
        wait = self.stop_timeout if timeout is None else timeout
        return (wait if save else 0.0), min(wait, 10.0), 5.0

    def stop_ticks(self, timeout: float | None = None, *, save: bool = True) -> list[str]:
        """site.sh's `--stop-ticks`: the 0.1 s ticks of each of the three waits
        (`_stop_waits`). `save=False`: SIGTERM follows SIGINT at once — the trainer takes a
        second signal as "end now, without the checkpoint"."""
        waits = self._stop_waits(timeout, save)
        return [str(max(1, round(s * 10)) if s else 0) for s in waits]

    def stop_seconds(self, timeout: float | None = None) -> float:
        """The longest site.sh's `job_stop` waits for the job (its three signals' waits)."""
        return sum(self._stop_waits(timeout))

    def parse_line(self, line: str) -> JobState:
        """The `JobState` of a state line printed by site.sh (`stopped`, `started`)."""
        return self._parse_state(TmuxResult(0, line, ""))[0]

    # log --------------------------------------------------------------------------------

    def tail(self, lines: int, *, cap: int = LOG_CAP) -> LogTail:
        """The last `lines` lines of the log among its last `cap` bytes, read at the place."""
        argv = ["bash", "-c", _SIZE_AND_TAIL, "dflash-tail", self.log, str(max(0, lines))]
        result = self.place.run([*argv, str(max(1, cap))], cap=cap + 64)
        head, _, body = result.stdout.partition(b"\n")
        size, _, before = head.decode("ascii", "replace").partition(" ")
        end = int(size) if size.lstrip("-").isdigit() else -1
        skipped = int(before) if before.isdigit() else 0
        body = body if end > 0 else b""
        # All `cap` bytes came back: fewer lines than asked fit, so the first one may be cut.
        cut = skipped if skipped and len(body) >= end - skipped else 0
        return LogTail(body=body, size=end, cut=cut)

    def read_from(self, offset: int, write: Callable[[bytes], None]) -> None:
        """Every byte of the log from `offset` on to `write`, as it comes (nothing when there is
        no log)."""
        with self.place.stream(["tail", "-c", f"+{offset + 1}", "--", self.log]) as rest:
            for chunk in rest:
                write(chunk)

    def follow(
        self,
        write: Callable[[bytes], None],
        *,
        offset: int,
        reconnect: Callable[[], Place] | None = None,
        attempts: int = 8,
        poll: float = 0.2,
    ) -> JobState:
        """Stream the log from byte `offset` until the job has ended and the log is drained.

        One channel runs `tail -c +OFFSET -F LOG` next to a loop that ends it once the job's
        process is gone (a constant script, values as arguments); new bytes arrive as written. A dropped connection is
        retried with backoff (0.25 s doubling to 4 s, `attempts` times) through `reconnect`,
        resuming at the byte after the last one written, so no line is lost or repeated.
        Returns the job's final state (its `exit_code` is the job's status when tmux kept it).
        """
        failures = 0
        while True:
            try:
                current = self.state()
                if current.running and current.pid is not None:
                    argv = [
                        "bash", "-c", _FOLLOW, "dflash-follow",
                        str(max(offset, 0) + 1), str(current.pid), self.log, str(poll),
                    ]  # fmt: skip
                    stream = self.place.stream(argv)
                    try:
                        for chunk in stream:
                            if chunk:
                                write(chunk)
                                offset += len(chunk)
                                failures = 0
                    finally:
                        close = getattr(stream, "close", None)
                        if close is not None:
                            close()  # Ctrl-C or an error: end our tail, never the job
                    current = self.state()
                    if current.running:
                        time.sleep(poll)  # the process is gone, tmux has not reaped it yet
                if not current.running:
                    self.read_from(max(offset, 0), write)
                    return current
            except ConnectionFailed as exc:
                failures += 1
                if reconnect is None or failures > attempts:
                    raise
                delay = min(4.0, 0.25 * 2 ** (failures - 1))
                log.warning("connection lost (%s); reconnecting in %.2f s", exc, delay)
                time.sleep(delay)
                try:
                    self.place = reconnect()
                except ConnectionFailed as again:
                    log.warning("reconnect failed: %s", again)


def _tmux_missing(where: str) -> DflashError:
    return DflashError(
        f"tmux is not installed on {where}.",
        hint="Install it there (e.g. apt-get install tmux), then run the command again.",
    )
