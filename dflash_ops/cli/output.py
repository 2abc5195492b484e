"""Everything the CLI prints: rich on a terminal, plain text when piped.

Progress and errors go to stderr, data (log bytes, `status --json`) to stdout, so
`dflash logs | grep loss` and `dflash status --json | jq` see only data.

Much of what is printed comes from the place (log lines, tmux's and pct's errors, file names,
nvidia-smi's answer), so both consoles render every character they print through
`untrusted.visible` (`_Visible`, below the colours this module adds), messages have their lines
bounded (`untrusted.clip`), and log or tool bytes go out rendered (`RemoteBytes`) unless the
operator asked for them raw.
"""

from __future__ import annotations

import logging
import sys
import traceback
from typing import Any

from rich import filesize
from rich.console import Console, ConsoleOptions, ConsoleRenderable, RenderHook, RenderResult
from rich.logging import RichHandler
from rich.markup import escape
from rich.segment import Segment

from dflash_ops.errors import DflashError
from dflash_ops.remote.job import JobState, StartUp
from dflash_ops.untrusted import Renderer, clip, visible

MESSAGE_LINE = 2000  # characters of one line of a message (a quoted remote line is shorter)


class _Shown:
    """A renderable whose text segments are rendered visible (its styles, ours, are kept)."""

    def __init__(self, inner: ConsoleRenderable) -> None:
        self.inner = inner

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for segment in console.render(self.inner, options):
            yield segment if segment.control else Segment(visible(segment.text), segment.style)


class _Visible(RenderHook):
    """Every renderable a console prints, through `_Shown`."""

    def process_renderables(self, renderables: list[ConsoleRenderable]) -> list[ConsoleRenderable]:
        return [_Shown(r) for r in renderables]


class _Console(Console):
    """A console that renders what it prints visible: text handed to `print` before rich reads
    it (rich drops a few control characters, BEL and CR among them, where they should show),
    and every other renderable (a table of remote names) through `_Visible`."""

    def __init__(self, *, stderr: bool) -> None:
        super().__init__(stderr=stderr, highlight=False, soft_wrap=True)
        self.push_render_hook(_Visible())

    def print(self, *objects: Any, **options: Any) -> None:
        super().print(*(visible(o) if isinstance(o, str) else o for o in objects), **options)


out = _Console(stderr=False)
err = _Console(stderr=True)


def message(text: str) -> str:
    """A message as printed: markup escaped, each line bounded (`clip`)."""
    return escape("\n".join(clip(line, MESSAGE_LINE) for line in text.split("\n")))


def info(text: str) -> None:
    err.print(message(text))


def success(text: str) -> None:
    err.print(f"[green]✓[/green] {message(text)}")


def warn(text: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {message(text)}")


def hint(text: str) -> None:
    err.print(f"[cyan]hint:[/cyan] {message(text)}")


# Said by status, logs and stop when this folder never deployed to the target and no job is there.
NEVER_DEPLOYED = "No job deployed from here ({folder}) to {place}."
NEVER_DEPLOYED_HINT = (
    "Deploy from this folder with: dflash deploy. A job deployed from another folder is that "
    "project's (its own tmux socket): run dflash there, or pass its --target/--host."
)


def size(n: int) -> str:
    """Bytes for a person: `121 bytes`, `1.0 MB`, `2.26 GB` (powers of 1000, as `du --si`)."""
    return filesize.decimal(n, precision=1 if n < 10**9 else 2)


def plural(n: int, one: str, many: str | None = None) -> str:
    """`1 entry`, `3 entries`, `0 runs`."""
    return f"{n:,} {one if n == 1 else many or one + 's'}"


def started(job: JobState, startup: StartUp | None, *, waited: float) -> str:
    """How the job just started is doing, for the success line of deploy, restart, rollback:
    past start-up, still starting after the wait, or exited 0 (its lines follow)."""
    name = repr(job.session)
    if startup is None or startup.outcome == "interrupted":
        return f"job {name} {'running' if job.running else 'exited already'}"
    if startup.outcome == "ready":
        return f"job {name} running, past start-up"
    if startup.outcome == "starting":
        return f"job {name} running, still starting after {waited:g} s (dflash logs --follow)"
    return f"job {name} exited 0 at start-up; the last lines of its log:"


def went_on(doing: str, release: str, *, interrupted: bool) -> None:
    """After a Ctrl-C that came once the old job was stopping: which job runs now."""
    if interrupted:
        info(
            f"Interrupted after the running job was stopped: the {doing} went on: release "
            f"{release} is running."
        )


def startup_lines(startup: StartUp | None) -> None:
    """The log's last lines of a job that exited 0 at start-up (nothing left to do, say)."""
    if startup is not None and startup.outcome == "ended":
        for line in startup.lines:
            info(f"  {line}")


def error(exc: DflashError) -> None:
    """One clear message and, when there is one, the next step."""
    err.print(f"[bold red]error:[/bold red] {message(str(exc))}")
    if exc.hint:
        hint(exc.hint)


def internal(exc: BaseException, *, verbose: bool) -> None:
    """A bug: still no traceback unless asked for."""
    err.print(f"[bold red]error:[/bold red] internal error: {escape(repr(exc))}")
    if verbose:
        err.print(escape("".join(traceback.format_exception(exc))))
    else:
        err.print("[cyan]hint:[/cyan] Run again with --verbose to see where it happened.")


class RemoteBytes:
    """Bytes from the place (the job's log, a foreground tool's output) to stdout, at once
    (`logs --follow` promises half a second): rendered visible, or unchanged when `raw` (the
    job's own colours, for a terminal the operator trusts with them). Call `end` once the
    stream is over (a character cut at its very end)."""

    def __init__(self, *, raw: bool = False) -> None:
        self._renderer = None if raw else Renderer()

    def __call__(self, data: bytes) -> None:
        self._write(data if self._renderer is None else self._renderer.feed(data).encode())

    def end(self) -> None:
        if self._renderer is not None:
            self._write(self._renderer.end().encode())

    @staticmethod
    def _write(data: bytes) -> None:
        if data:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()


class _VisibleFormatter(logging.Formatter):
    """--verbose lines on a plain stderr: what they quote from the place rendered visible."""

    def format(self, record: logging.LogRecord) -> str:
        return visible(super().format(record))


def setup_logging(verbose: bool) -> None:
    if not verbose:
        logging.getLogger().setLevel(logging.WARNING)
        # paramiko logs a dropped or non-SSH peer as ERROR lines and tracebacks; the error
        # that reaches the user already says what happened, so those lines only with --verbose.
        logging.getLogger("paramiko").setLevel(logging.CRITICAL + 1)
        return
    handler: logging.Handler
    if err.is_terminal:
        handler = RichHandler(console=err, show_path=False)
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(_VisibleFormatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.DEBUG, handlers=[handler], force=True)
    logging.getLogger("paramiko").setLevel(logging.INFO)
    # libtmux logs whole tmux command lines, which carry the job's env values (tokens, maybe).
    logging.getLogger("libtmux").setLevel(logging.INFO)
