"""Where commands run: a host itself, or one LXC container on a Proxmox VE host.

`HostPlace(transport)` runs argv as given. `ContainerPlace(transport, ct)` runs
`pct exec <ct> --keep-env 0 -- argv…` on the host: argv goes after `--`, so pct reads none of it
as its own options, and no shell inside the container ever sees it (pct exec has none).
`--keep-env 0` matters: pct's default still copies the host's environment into the container.
With it, the command starts with only PATH (the standard one) and `container=lxc`; HOME is
not set, so the job layer sets the environment it needs itself.

pct reports a missing or stopped container on stderr before it runs anything; a failed command
whose last stderr line is one of those messages raises `ContainerNotFound`/`ContainerStopped`
(whatever `check` says: that exit status is pct's, not the command's). A host without pct
raises `PctMissing`.

Nothing waits forever on a place: every command run there is bounded by the place's `timeout`
(`[target] timeout` in deploy.toml) unless its caller gives it its own, and one that does not
finish in time is ended and raises `CommandTimedOut` naming it (`what_runs`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Protocol, runtime_checkable

from dflash_ops.connect import shell
from dflash_ops.connect.stdin import Stdin
from dflash_ops.connect.transport import STDOUT_CAP, Result, StreamResult, Transport, Watch
from dflash_ops.errors import (
    CommandTimedOut,
    ContainerNotFound,
    ContainerStopped,
    PctMissing,
    RemoteCommandFailed,
)

# pve-container's own messages (PVE::LXC::Config->load_config and `pct exec`).
_NOT_FOUND = re.compile(r"Configuration file 'nodes/[^/]+/lxc/(\d+)\.conf' does not exist")
_NOT_RUNNING = re.compile(r"container '(\d+)' not running!")
# bash: "bash: line 1: pct: command not found"; dash: "sh: 1: pct: not found"; local: "pct: …".
_PCT_MISSING = re.compile(r"(^|[\s:])pct: (command )?not found$")
# Seconds one command (one step of the site program) may take at a place: a slow container
# included (a cold `import torch` there takes tens of seconds), a hung one not for long.
DEFAULT_TIMEOUT = 120.0


@runtime_checkable
class Place(Protocol):
    """Where commands run. `run(…, cap=…, watch=…)`: the first `cap` bytes of stdout are kept;
    `watch` sees stdout as it arrives and may move the command's bound (`bounded.Watch`)."""

    description: str
    transport: Transport
    timeout: float  # the bound of each command run without one of its own

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin = None,
        timeout: float | None = None,
        check: bool = True,
        cap: int = STDOUT_CAP,
        watch: Watch | None = None,
    ) -> Result: ...

    def stream(self, argv: Sequence[str]) -> StreamResult: ...

    def ensure_ready(self) -> None: ...

    def close(self) -> None: ...


def what_runs(argv: Sequence[str]) -> str:
    """The name of a command in messages: `bash -c SCRIPT NAME …` by NAME, `env K=V … prog`
    by prog, `tmux [-L S] sub …` by `tmux sub` (`pct sub …` alike), anything else by its
    program."""
    args = list(argv)
    if args[:2] == ["bash", "-c"] and len(args) > 3:
        return args[3]
    while args[:1] == ["env"] or (args and "=" in args[0] and args[0] != "="):
        args = args[1:]
    if args[:1] in (["tmux"], ["pct"]):
        rest = args[3:] if args[1:2] == ["-L"] else args[1:]
        return " ".join([args[0], *rest[:1]])
    return args[0] if args else "?"


def timed_out(argv: Sequence[str], seconds: float, where: str) -> CommandTimedOut:
    """The error of a command at `where` that did not answer within `seconds`."""
    return CommandTimedOut(
        f"`{what_runs(argv)}` did not answer within {seconds:g} s on {where}; it was ended.",
        hint="Look at the place: is something there hung (ps, tmux, the disk)? If it is only "
        "slow, raise timeout in the target's table of deploy.toml "
        f"(now {seconds:g} s).",
    )


def _run(
    place: Place,
    argv: Sequence[str],
    sent: Sequence[str],
    *,
    stdin: Stdin,
    timeout: float | None,
    cap: int,
    watch: Watch | None,
) -> Result:
    """`sent` (argv as the transport runs it) bounded by `timeout`, else by its `watch`, else
    by the place's `timeout`."""
    seconds = place.timeout if timeout is None and watch is None else timeout
    try:
        return place.transport.run(sent, stdin=stdin, timeout=seconds, cap=cap, watch=watch)
    except CommandTimedOut:
        if seconds is None:
            raise  # its watch knows which step it was
        raise timed_out(argv, seconds, place.description) from None


def raise_for_result(result: Result, place: str) -> Result:
    """Return `result` if it succeeded, else raise `RemoteCommandFailed` describing it."""
    if result.exit_code != 0:
        raise RemoteCommandFailed(place, result.argv, result.exit_code, result.stderr_text)
    return result


class HostPlace:
    """Commands run directly at the transport's end (this machine or an SSH host)."""

    def __init__(self, transport: Transport, *, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.transport = transport
        self.description = transport.description
        self.timeout = timeout

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin = None,
        timeout: float | None = None,
        check: bool = True,
        cap: int = STDOUT_CAP,
        watch: Watch | None = None,
    ) -> Result:
        result = _run(self, argv, argv, stdin=stdin, timeout=timeout, cap=cap, watch=watch)
        return raise_for_result(result, self.description) if check else result

    def stream(self, argv: Sequence[str]) -> StreamResult:
        return self.transport.stream(argv)

    def ensure_ready(self) -> None:
        """Open the connection now (host key, authentication); no command runs for it."""
        self.transport.connect()

    def close(self) -> None:
        self.transport.close()


_PCT_STATUS_CAP = 1024  # bytes of `pct status` kept: `status: running`, or what went wrong


class ContainerPlace:
    """Commands run inside LXC container `ct` through `pct exec` on the transport's host."""

    def __init__(
        self, transport: Transport, ct: int | str, *, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self.transport = transport
        self.ct = shell.container_id(ct)
        self.description = f"ct {self.ct} on {transport.description}"
        self.timeout = timeout

    def pct_argv(self, argv: Sequence[str]) -> list[str]:
        """`pct exec <ct> --keep-env 0 -- argv…`"""
        return ["pct", "exec", str(self.ct), "--keep-env", "0", "--", *argv]

    def _stopped(self) -> ContainerStopped:
        """One message whether `pct status` or a refused `pct exec` told us."""
        return ContainerStopped(
            f"Container {self.ct} on {self.transport.description} is stopped (not running)",
            hint=f"Start it on the host with: pct start {self.ct}",
        )

    def _raise_for_pct(self, exit_code: int | None, stderr: bytes) -> None:
        """Turn pct's own failures (not the command's) into their specific errors."""
        if not exit_code:
            return
        lines = stderr.decode("utf-8", errors="replace").strip().splitlines()
        last = lines[-1].strip() if lines else ""
        host = self.transport.description
        if _NOT_FOUND.search(last):
            raise ContainerNotFound(f"Container {self.ct} does not exist on {host}")
        if _NOT_RUNNING.search(last):
            raise self._stopped()
        if exit_code == 127 and _PCT_MISSING.search(last):
            raise PctMissing(f"{host} has no `pct` command: it is not a Proxmox VE node")

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin = None,
        timeout: float | None = None,
        check: bool = True,
        cap: int = STDOUT_CAP,
        watch: Watch | None = None,
    ) -> Result:
        sent = self.pct_argv(argv)
        raw = _run(self, argv, sent, stdin=stdin, timeout=timeout, cap=cap, watch=watch)
        self._raise_for_pct(raw.exit_code, raw.stderr)
        result = replace(raw, argv=tuple(argv))
        return raise_for_result(result, self.description) if check else result

    def stream(self, argv: Sequence[str]) -> StreamResult:
        inner = self.transport.stream(self.pct_argv(argv))

        def chunks() -> Iterator[bytes]:
            yield from inner

        def finish() -> tuple[int, bytes]:
            assert inner.exit_code is not None
            self._raise_for_pct(inner.exit_code, inner.stderr)
            return inner.exit_code, inner.stderr

        return StreamResult(argv, chunks(), finish, inner.close)

    def ensure_ready(self) -> None:
        """`pct status <ct>` on the host: pct present, container exists and is running."""
        argv = ["pct", "status", str(self.ct)]
        try:
            # its answer is one short line: the first KiB of it is all that is read into memory
            result = self.transport.run(argv, timeout=self.timeout, cap=_PCT_STATUS_CAP)
        except CommandTimedOut:
            raise timed_out(argv, self.timeout, self.transport.description) from None
        self._raise_for_pct(result.exit_code, result.stderr)
        status = result.stdout_text.strip()
        if result.exit_code != 0:
            raise_for_result(result, self.transport.description)
        if status == "status: stopped":
            raise self._stopped()
        if status != "status: running":
            raise RemoteCommandFailed(
                self.transport.description,
                result.argv,
                result.exit_code,
                f"unexpected answer from pct status: {status!r}",
            )

    def close(self) -> None:
        self.transport.close()
