"""`dflash attach`: this terminal on the job's tmux pane, until you detach."""

from __future__ import annotations

import os
import shutil
import sys

import typer

from dflash_ops.cli import output
from dflash_ops.cli.context import never_deployed_hint, workspace
from dflash_ops.cli.options import TargetChoice, with_target
from dflash_ops.commands import attach as attaching
from dflash_ops.errors import DflashError, JobNotFound

app = typer.Typer()


@app.command()
@with_target
def attach(ctx: typer.Context, *, where: TargetChoice) -> None:
    """Attach this terminal to the job's tmux pane (its private socket), here, over ssh, or
    inside the container on a Proxmox node.

    Detach with Ctrl-b d: the job keeps running. Ctrl-c in the pane stops the job the way
    dflash stop does first (SIGINT: the trainer saves and exits). The job's output goes to its
    log (dflash logs), not to the pane.

    \b
    Examples:
      dflash attach
      dflash attach --target gpu-box
    """
    if not sys.stdin.isatty() or not sys.stdout.isatty():
        raise DflashError(
            "dflash attach needs a terminal (stdin and stdout).",
            hint="Run it in a terminal; to run one command at the place, use dflash exec -- CMD",
        )
    with workspace(ctx, where) as ws:
        try:
            state = attaching.session(ws)
        except JobNotFound:
            if ws.deployed_here:
                raise
            place = ws.target.describe()
            raise JobNotFound(
                output.NEVER_DEPLOYED.format(folder=ws.config.project_dir, place=place),
                hint=never_deployed_hint(ws),
            ) from None
        argv = attaching.attach_argv(ws)
    if not state.running:
        output.warn(f"The job has exited (code {state.exit_code}); its pane is kept.")
    output.info(
        f"Attaching to job {state.session!r} on {ws.target.describe()}: detach with "
        f"{attaching.DETACH} (the job keeps running)."
    )
    program = shutil.which(argv[0])
    if program is None:
        raise DflashError(f"{argv[0]} is not installed here.", hint=f"Install {argv[0]}.")
    env = {k: v for k, v in os.environ.items() if k != "TMUX"}  # also from inside a tmux
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(program, argv, env)
