"""`dflash releases` and `dflash rollback`: what is deployed at the target, and going back."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from dflash_ops.cli import output
from dflash_ops.cli.context import workspace
from dflash_ops.cli.options import (
    ForceOption,
    NoWaitOption,
    TargetChoice,
    with_target,
)
from dflash_ops.commands import operations

app = typer.Typer()


def _revision(meta: dict[str, Any]) -> str:
    source = meta.get("source")
    if not isinstance(source, dict) or not source.get("revision"):
        return "-"
    return str(source["revision"])[:12] + ("+dirty" if source.get("dirty") else "")


@app.command()
@with_target
def releases(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    *,
    where: TargetChoice,
) -> None:
    """List the complete releases at the target: id, time, size, source revision, current.

    \b
    Examples:
      dflash releases
      dflash releases --json
    """
    with workspace(ctx, where) as ws:
        infos = ws.releases().describe()
    rows = [
        {
            "id": info.release_id,
            "created": info.meta.get("created"),
            "size": info.size,
            "revision": _revision(dict(info.meta)),
            "by": info.meta.get("by"),
            "current": info.current,
        }
        for info in infos
    ]
    if as_json:
        print(json.dumps({"root": ws.target.root, "releases": rows}))
        return
    if not rows:
        output.info(f"No releases at {ws.target.root} on {ws.target.describe()}.")
        return
    table = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0), header_style="bold")
    for name in ("", "release", "created", "size", "revision"):
        table.add_column(name, justify="right" if name == "size" else "left")
    for info in infos:
        table.add_row(
            "*" if info.current else "",
            info.release_id,
            escape(str(info.meta.get("created") or "-")),
            output.size(info.size),
            escape(_revision(dict(info.meta))),
        )
    output.out.print(table)
    output.info(f"{output.plural(len(rows), 'release')}; * = current")


@app.command()
@with_target
def rollback(
    ctx: typer.Context,
    to: Annotated[
        str | None,
        typer.Option(
            "--to", metavar="ID", help="Release id to go back to (default: the previous one)."
        ),
    ] = None,
    *,
    where: TargetChoice,
    force: ForceOption = False,
    no_wait: NoWaitOption = False,
) -> None:
    """Point current at an earlier complete release and restart the job on it.

    The checkpoints stay in place: the trainer resumes from the newest one.

    \b
    Examples:
      dflash rollback
      dflash rollback --to 20260102-030405-678-abcd
    """
    with workspace(ctx, where) as ws:
        report = operations.rollback(
            ws, to=to, force=force, say=output.warn, progress=output.info, wait=not no_wait
        )
    waited = ws.config.job.start_wait
    output.success(
        f"Rolled back to {report.release}; "
        f"{output.started(report.started, report.startup, waited=waited)}."
    )
    output.startup_lines(report.startup)
    output.went_on("rollback", report.release, interrupted=report.interrupted)
