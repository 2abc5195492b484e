"""`dflash logs`: print the job's log, or follow it until the job ends."""

from __future__ import annotations

from typing import Annotated, NoReturn

import typer

from dflash_ops.cli import output
from dflash_ops.cli.context import command, never_deployed_hint, workspace
from dflash_ops.cli.options import (
    TargetChoice,
    with_target,
)
from dflash_ops.commands.workspace import Workspace
from dflash_ops.errors import JobNotFound
from dflash_ops.untrusted import more

app = typer.Typer()


@app.command()
@with_target
def logs(
    ctx: typer.Context,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow", "-f", help="Keep printing new lines; exit with the job's exit code."
        ),
    ] = False,
    tail: Annotated[
        int,
        typer.Option(
            "--tail", "-n", metavar="N", min=0, help="How many of the last lines to print first."
        ),
    ] = 50,
    raw: Annotated[
        bool,
        typer.Option(
            "--raw",
            help="Print the log's bytes unchanged (the job's colours and any other escape "
            "sequence reach the terminal); by default control characters are shown as ^[ …",
        ),
    ] = False,
    *,
    where: TargetChoice,
) -> None:
    """Print the last lines of the job's log; with --follow, stream it until the job ends.

    --follow prints new lines as they are written, survives a dropped connection (it
    reconnects and resumes at the same byte), and exits with the job's exit code once the
    job has ended. Ctrl-C only stops watching: the job keeps running. Control characters in
    the log (escape sequences, colours) are shown as ^[ and the like; --raw prints them as
    they are.

    \b
    Examples:
      dflash logs                 # the last 50 lines
      dflash logs --tail 200
      dflash logs --follow        # exit code = the job's exit code
      dflash logs --follow --raw  # with the job's own colours
    """
    show = output.RemoteBytes(raw=raw)
    with workspace(ctx, where) as ws:
        try:
            job = ws.job()
            found = job.tail(tail)
            size = found.size
            if found.cut:
                output.info(f"{more(found.cut)} of the log before these lines")
            show(found.body)
            if size < 0 and not ws.deployed_here and not job.state().exists:
                _never_deployed(ws)
            if not follow:
                if size < 0:
                    output.info(f"No log yet at {ws.log_path} on {ws.target.describe()}.")
                return
            final = job.follow(show, offset=max(size, 0), reconnect=ws.reopen)
        except KeyboardInterrupt:
            output.info("Detached from the log; the job keeps running.")
            raise typer.Exit(130) from None
        finally:
            show.end()
        if not final.exists and not ws.deployed_here:
            _never_deployed(ws)
    if not final.exists:
        raise JobNotFound(
            f"No job session {final.session!r} on {ws.target.describe()}: nothing to follow.",
            hint=f"Start one with: {command(ctx, 'deploy')}",
        )
    if final.exit_code is None:
        output.warn("The session ended before its exit status could be read.")
        raise typer.Exit(1)
    output.info(f"Job exited with code {final.exit_code}.")
    raise typer.Exit(final.exit_code)


def _never_deployed(ws: Workspace) -> NoReturn:
    """Logs asked for in a folder that never deployed: an error (exit 1), never another
    project's job."""
    place = ws.target.describe()
    raise JobNotFound(
        output.NEVER_DEPLOYED.format(folder=ws.config.project_dir, place=place),
        hint=never_deployed_hint(ws),
    )
