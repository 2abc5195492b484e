"""`dflash deploy`: ship the trainer to the target and start a fresh (or resumed) job."""

from __future__ import annotations

from typing import Annotated

import typer

from dflash_ops.cli import output
from dflash_ops.cli.context import command, not_on_path, shared_root_notice, workspace
from dflash_ops.cli.options import (
    ForceOption,
    NoWaitOption,
    TargetChoice,
    with_target,
)
from dflash_ops.commands import gpus, operations

app = typer.Typer()


@app.command()
@with_target
def deploy(
    ctx: typer.Context,
    *,
    where: TargetChoice,
    force: ForceOption = False,
    no_wait: NoWaitOption = False,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume", help="Keep the checkpoints in place: the trainer resumes from the newest."
        ),
    ] = False,
    force_resume: Annotated[
        bool,
        typer.Option(
            "--force-resume",
            help="With --resume: resume even from a checkpoint written with other model/data "
            "settings (this start only).",
        ),
    ] = False,
) -> None:
    """Ship trainer/ to the target and (re)start the job there.

    Builds a release (trainer/, the [train] settings, a launch script), sends it as one tar
    stream into <root>/releases/<id>, stops the running job, switches <root>/current to the
    release, keeps the last 5, archives the old checkpoints (unless --resume) and starts the
    job in tmux, then waits until it is past start-up (the trainer's "started training" line, at
    most [job] start_wait seconds): a job that ended there fails the deploy with its log's last
    lines. The target is remembered for the next commands run from this folder. Ctrl-C before
    the running job is stopped changes nothing; from the stop on, the deploy goes on to start
    the new release (and says so).

    \b
    Examples:
      dflash deploy                          # [target] from deploy.toml (local by default)
      dflash deploy --host gpu-box           # an SSH host
      dflash deploy --host pve --ct 200      # container 200 on a Proxmox node
      dflash deploy --target gpu-box --resume
      dflash deploy --resume --force-resume  # after changing model/data settings
    """
    if force_resume and not resume:
        raise typer.BadParameter(
            "--force-resume needs --resume (without it the checkpoints are archived).",
            param_hint="--force-resume",
        )
    with workspace(ctx, where) as ws:
        if ws.in_shared_root:
            output.warn(shared_root_notice(ws))
        report = operations.deploy(
            ws,
            resume=resume,
            force_resume=force_resume,
            force=force,
            say=output.info,
            warn=output.warn,
            wait=not no_wait,
        )
        idle = gpus.unused(ws.config.job, seen=report.devices)
    if report.removed:
        output.info(f"Removed old releases: {', '.join(report.removed)}")
    waited = ws.config.job.start_wait
    output.success(
        f"Deployed {report.release} to {ws.target.describe()}; "
        f"{output.started(report.started, report.startup, waited=waited)}."
    )
    output.startup_lines(report.startup)
    output.went_on("deploy", report.release, interrupted=report.interrupted)
    if idle:
        warning, fix = gpus.unused_words(idle, ws.target.describe(), str(ws.config.path))
        output.warn(warning)
        output.hint(fix)
    output.info(f"Follow it with: {command(ctx, 'logs', '--follow')}")
    if (advice := not_on_path()) is not None:
        output.info(advice)
