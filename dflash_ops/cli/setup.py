"""`dflash setup`: build the job's environment at the place (the `[venv]` of deploy.toml)."""

from __future__ import annotations

import typer

from dflash_ops.cli import output
from dflash_ops.cli.context import workspace
from dflash_ops.cli.options import TargetChoice, with_target
from dflash_ops.commands import environment

app = typer.Typer()


@app.command()
@with_target
def setup(ctx: typer.Context, *, where: TargetChoice) -> None:
    """Build the job's python at the place: the [venv] of deploy.toml.

    Creates <root>/venvs/<key> from the target's python (python -m venv), installs
    trainer/requirements.txt and [venv] packages into it with pip (torch first from
    [venv] torch_index; with [venv] wheels every package from that folder, offline), checks
    in one python -c that every module the trainer imports is there, and marks it complete.
    A complete venv is reused: nothing is installed again until the requirements change.
    dflash deploy runs this by itself when the venv is missing.

    \b
    Examples:
      dflash setup
      dflash setup --host pve --ct 200
    """
    with workspace(ctx, where) as ws:
        built = environment.build(ws, say=output.info)
    state = "built" if built.fresh else "ready (built before)"
    output.success(f"The job's venv {built.folder} on {ws.target.describe()} is {state}.")
