"""`dflash plan`: time the target and the drafter alone at the place, predict every GPU split."""

from __future__ import annotations

from typing import Annotated

import typer

from dflash_ops.cli.context import workspace
from dflash_ops.cli.foreground import drain
from dflash_ops.cli.options import (
    TargetChoice,
    with_target,
)
from dflash_ops.commands import plan as planning

app = typer.Typer()


@app.command()
@with_target
def plan(
    ctx: typer.Context,
    gpus: Annotated[
        int | None,
        typer.Option(
            "--gpus",
            metavar="G",
            min=1,
            help="GPUs of the node to split (default: [job] gpus, else visible).",
        ),
    ] = None,
    steps: Annotated[
        int | None, typer.Option("--steps", metavar="N", min=1, help="Timed batches per role.")
    ] = None,
    warmup: Annotated[
        int | None,
        typer.Option(
            "--warmup", metavar="N", min=0, help="Untimed batches per role (compiles, warm-up)."
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the planner's report as one JSON object.")
    ] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Time even while the job runs on the same GPUs.")
    ] = False,
    *,
    where: TargetChoice,
) -> None:
    """Measure each role alone at the place and print the predicted tokens/s of every
    target + drafter split of the node, and the best one.

    Runs `python -m trainer plan` in the foreground, in the current release with its
    train.toml, the target's python and the [job] env. Refused while the job runs (dflash stop
    first): timings on busy GPUs are meaningless. Set the best split as [job] target_gpus.

    \b
    Examples:
      dflash stop && dflash plan
      dflash plan --gpus 8 --steps 10
      dflash plan --json | jq .best
    """
    with workspace(ctx, where) as ws:
        request = planning.PlanRequest(
            gpus=gpus, steps=steps, warmup=warmup, as_json=as_json, force=force
        )
        stream = planning.start(ws, request)
        code = drain(stream, what="planner", failure=lambda s: planning.failure(ws, s))
    raise typer.Exit(code)
