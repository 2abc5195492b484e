"""`dflash deploy`: ship the trainer to the target and start a fresh (or resumed) job."""

from __future__ import annotations

from typing import Annotated

import typer

from dflash_ops.cli import output
from dflash_ops.cli.context import command, not_on_path, shared_root_notice, workspace
from dflash_ops.cli.options import (
    ForceOption,
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
    stream into <root>/releases/<id>, switches <root>/current to it, keeps the last 5,
    stops the running job, archives the old checkpoints (unless --resume) and starts the job
    in tmux. The target is remembered for the next commands run from this folder.

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
        )
        idle = gpus.unused(ws.config.job, seen=report.devices)
    if report.removed:
        output.info(f"Removed old releases: {', '.join(report.removed)}")
    output.success(
        f"Deployed {report.release} to {ws.target.describe()}; job {report.started.session!r} "
        f"{'running' if report.started.running else 'exited already'}."
    )
    if idle:
        warning, fix = gpus.unused_words(idle, ws.target.describe(), str(ws.config.path))
        output.warn(warning)
        output.hint(fix)
    output.info(f"Follow it with: {command(ctx, 'logs', '--follow')}")
    if (advice := not_on_path()) is not None:
        output.info(advice)
