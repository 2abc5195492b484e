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
    AcceptKeyOption,
    CtOption,
    HostOption,
    PortOption,
    TargetOption,
    UserOption,
    target_flags,
)

app = typer.Typer()


@app.command()
def checkpoints(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    target: TargetOption = None,
    host: HostOption = None,
    user: UserOption = None,
    port: PortOption = None,
    ct: CtOption = None,
    accept_new_host_key: AcceptKeyOption = False,
) -> None:
    """List the checkpoints folder: the live entries, and each archived run.

    Fresh runs (deploy without --resume, restart --clean) move the live entries into
    <checkpoints>/archive/<UTC time>/; nothing is deleted.

    \b
    Examples:
      dflash checkpoints
      dflash checkpoints --json
    """
    flags = target_flags(target=target, host=host, user=user, port=port, ct=ct)
    ws = workspace(ctx, flags, accept_new_host_key=accept_new_host_key)
    try:
        listing = ws.checkpoints().list()
    finally:
        ws.close()
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
        say(f"  {escape(stamp)}  {len(entries)} entries")
    if not listing.archived:
        say("  (none)")
