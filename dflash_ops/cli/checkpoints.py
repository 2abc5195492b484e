"""`dflash checkpoints`: what is in the checkpoints folder, live and archived."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Annotated

import typer
from rich.markup import escape

from dflash_ops.cli import output
from dflash_ops.cli.context import workspace
from dflash_ops.cli.options import (
    TargetChoice,
    with_target,
)
from dflash_ops.remote import client

app = typer.Typer()
group = typer.Typer(name="checkpoints", invoke_without_command=True, no_args_is_help=False)
app.add_typer(group)


@group.callback()
@with_target
def checkpoints(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    *,
    where: TargetChoice,
) -> None:
    """List the checkpoints folder: the live entries, and each archived run.

    Fresh runs (deploy without --resume, restart --clean) move the live entries into
    <checkpoints>/archive/<UTC time>/; nothing is deleted unless you prune.

    \b
    Examples:
      dflash checkpoints
      dflash checkpoints --json
      dflash checkpoints prune --keep 3
    """
    if ctx.invoked_subcommand is not None:
        return
    with workspace(ctx, where) as ws:
        listing = ws.checkpoints().list()
    if as_json:
        print(json.dumps({"path": ws.target.checkpoints, **dataclasses.asdict(listing)}))
        return
    say = output.out.print
    say(f"[bold]live[/bold] {escape(ws.target.checkpoints)}")
    for entry in listing.live:
        when = dt.datetime.fromtimestamp(entry.mtime, dt.UTC)
        kind = "/" if entry.kind == "d" else ""
        say(f"  {when:%Y-%m-%d %H:%M}  {entry.size:>12,}  {escape(entry.name)}{kind}")
    if not listing.live:
        say("  (empty)")
    say("[bold]archived[/bold]")
    for stamp, entries in sorted(listing.archived.items()):
        size = sum(e.size for e in entries)
        say(f"  {escape(stamp)}  {size:>12,}  {len(entries)} entries")
    if not listing.archived:
        say("  (none)")
    for message in listing.foreign:
        output.warn(message)


@group.command()
@with_target
def prune(
    ctx: typer.Context,
    keep: Annotated[
        int, typer.Option("--keep", min=0, help="How many archived runs to keep (the newest).")
    ],
    *,
    where: TargetChoice,
) -> None:
    """Delete archived runs except the newest --keep N. Live checkpoints are never touched.

    A run is a folder archive/<UTC time>/ (what deploy and restart --clean create). Anything
    else in archive/ (a symlink, a file, another folder) is not a run: it is left alone and
    named in a warning, never followed, never counted among the N kept. Each deletion first
    proves, at the place, that the entry is such a run inside <checkpoints>/archive/.

    \b
    Examples:
      dflash checkpoints prune --keep 3
    """
    with workspace(ctx, where) as ws:
        report = client.prune_runs(ws.checkpoints(), keep=keep)
    for stamp in report.deleted:
        output.info(f"Deleted archived run {stamp}")
    for message in [*report.skipped, *report.refused]:
        output.warn(message)
    output.success(
        f"Pruned {len(report.deleted)} archived run(s); kept {len(report.kept)}"
        + (f"; refused {len(report.refused)}." if report.refused else ".")
    )
    if report.refused:
        raise typer.Exit(1)
