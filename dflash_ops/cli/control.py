"""`dflash stop` and `dflash restart`: end the job, or start it again on the current release."""

from __future__ import annotations

from typing import Annotated

import typer

from dflash_ops.cli import output
from dflash_ops.cli.context import never_deployed_hint, workspace
from dflash_ops.cli.options import (
    ForceOption,
    NoWaitOption,
    TargetChoice,
    with_target,
)
from dflash_ops.commands import operations

app = typer.Typer()


@app.command()
@with_target
def stop(
    ctx: typer.Context,
    *,
    where: TargetChoice,
    force: ForceOption = False,
    no_save: Annotated[
        bool,
        typer.Option(
            "--no-save",
            help="End the job now: SIGTERM right after SIGINT, no stop checkpoint (the steps "
            "since the last periodic checkpoint are lost).",
        ),
    ] = False,
) -> None:
    """Stop the job: SIGINT, then SIGTERM, then SIGKILL, then end its tmux session.

    On SIGINT the trainer finishes its current step, saves a checkpoint of it and exits 0
    ("stopped at step N, checkpoint saved to …" in the log); it gets [job] stop_timeout
    seconds for that before SIGTERM ends it.

    \b
    Examples:
      dflash stop
      dflash stop --target gpu-box
      dflash stop --no-save
    """
    with workspace(ctx, where) as ws:
        final = operations.stop(
            ws, force=force, save=not no_save, say=output.warn, progress=output.info
        )
        hint = None if final is not None or ws.deployed_here else never_deployed_hint(ws)
    place = ws.target.describe()
    if hint is not None:
        output.info(output.NEVER_DEPLOYED.format(folder=ws.config.project_dir, place=place))
        output.hint(hint)
    elif final is None:
        output.info(f"No job session {ws.config.job.session!r} on {place}: nothing to stop.")
    elif final.exit_code is None:
        output.success(
            f"Job {final.session!r} on {place} was stopped and its session closed (tmux had not "
            "recorded its exit status yet)."
        )
    else:
        output.success(
            f"Job {final.session!r} on {place} has ended (exit {final.exit_code}); session closed."
        )


@app.command()
@with_target
def restart(
    ctx: typer.Context,
    clean: Annotated[
        bool,
        typer.Option("--clean", help="Archive the checkpoints first: train from scratch."),
    ] = False,
    *,
    where: TargetChoice,
    force: ForceOption = False,
    no_wait: NoWaitOption = False,
) -> None:
    """Stop the job and start it again on the current release.

    Without --clean the trainer resumes from its newest checkpoint; with --clean the
    checkpoints are moved into <checkpoints>/archive/<time>/ first (nothing is deleted).
    Then it waits until the job is past start-up, as deploy does (--no-wait: not).

    \b
    Examples:
      dflash restart
      dflash restart --clean
    """
    with workspace(ctx, where) as ws:
        report = operations.restart(
            ws,
            clean=clean,
            force=force,
            say=output.warn,
            progress=output.info,
            wait=not no_wait,
        )
    if report.cleaned:
        output.info(
            f"Removed unfinished releases of interrupted deploys: {', '.join(report.cleaned)}"
        )
    if report.archived:
        output.info(f"Archived the checkpoints into {report.archived}.")
    waited = ws.config.job.start_wait
    output.success(
        f"Restarted on release {report.release}; "
        f"{output.started(report.started, report.startup, waited=waited)}."
    )
    output.startup_lines(report.startup)
    output.went_on("restart", report.release, interrupted=report.interrupted)
