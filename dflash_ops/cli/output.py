"""Everything the CLI prints: rich on a terminal, plain text when piped.

Progress and errors go to stderr, data (log bytes, `status --json`) to stdout, so
`dflash logs | grep loss` and `dflash status --json | jq` see only data.
"""

from __future__ import annotations

import logging
import sys
import traceback

from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape

from dflash_ops.errors import DflashError
from dflash_ops.remote.job import JobState, StartUp

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def info(message: str) -> None:
    err.print(escape(message))


def success(message: str) -> None:
    err.print(f"[green]✓[/green] {escape(message)}")


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {escape(message)}")


def hint(message: str) -> None:
    err.print(f"[cyan]hint:[/cyan] {escape(message)}")


# Said by status, logs and stop when this folder never deployed to the target and no job is there.
NEVER_DEPLOYED = "No job deployed from here ({folder}) to {place}."
NEVER_DEPLOYED_HINT = (
    "Deploy from this folder with: dflash deploy. A job deployed from another folder is that "
    "project's (its own tmux socket): run dflash there, or pass its --target/--host."
)


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
    err.print(f"[bold red]error:[/bold red] {escape(str(exc))}")
    if exc.hint:
        err.print(f"[cyan]hint:[/cyan] {escape(exc.hint)}")


def internal(exc: BaseException, *, verbose: bool) -> None:
    """A bug: still no traceback unless asked for."""
    err.print(f"[bold red]error:[/bold red] internal error: {escape(repr(exc))}")
    if verbose:
        err.print(escape("".join(traceback.format_exception(exc))))
    else:
        err.print("[cyan]hint:[/cyan] Run again with --verbose to see where it happened.")


def write_bytes(data: bytes) -> None:
    """Log bytes go out unchanged and at once (`logs --follow` promises half a second)."""
    sys.stdout.buffer.write(data)
    sys.stdout.buffer.flush()


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
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logging.basicConfig(level=logging.DEBUG, handlers=[handler], force=True)
    logging.getLogger("paramiko").setLevel(logging.INFO)
    # libtmux logs whole tmux command lines, which carry the job's env values (tokens, maybe).
    logging.getLogger("libtmux").setLevel(logging.INFO)
