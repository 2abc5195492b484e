"""`dflash checkpoints`: what is in the checkpoints folder, live and archived."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import sys
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from dflash_ops.cli import output
from dflash_ops.cli.context import workspace
from dflash_ops.cli.options import (
    TargetChoice,
    with_target,
)
from dflash_ops.commands import prune as pruning
from dflash_ops.errors import NotConfirmed
from dflash_ops.remote.checkpoints import Entry, PrunePlan

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
    say(f"[bold]live[/bold] {escape(ws.target.checkpoints)}: {_count(len(listing.live))}")
    if listing.live:
        say(_live_table(listing.live))
    say(f"[bold]archived runs[/bold]: {len(listing.archived)}")
    if listing.archived:
        say(_archived_table(listing.archived))
    for message in listing.foreign:
        output.warn(message)


def _count(n: int) -> str:
    return output.plural(n, "entry", "entries") if n else "empty"


def _table(*columns: str) -> Table:
    """A plain table with a header row; the first column left, sizes right."""
    table = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0), header_style="bold")
    for name in columns:
        table.add_column(name, justify="right" if name == "size" else "left")
    return table


def _live_table(entries: list[Entry]) -> Table:
    table = _table("modified (UTC)", "size", "name")
    for entry in entries:
        when = dt.datetime.fromtimestamp(entry.mtime, dt.UTC)
        kind = "/" if entry.kind == "d" else ""
        table.add_row(f"{when:%Y-%m-%d %H:%M}", output.size(entry.size), escape(entry.name + kind))
    return table


def _archived_table(runs: dict[str, list[Entry]]) -> Table:
    """Newest first: what `--checkpoint <archived run>` and `prune` name."""
    table = _table("archived run", "size", "entries", "checkpoints")
    for stamp, entries in sorted(runs.items(), reverse=True):
        steps = sorted(e.name for e in entries if e.kind == "d" and e.name.startswith("step-"))
        shown = ", ".join(steps[-2:]) + (f" (+{len(steps) - 2} older)" if len(steps) > 2 else "")
        table.add_row(
            escape(stamp),
            output.size(sum(e.size for e in entries)),
            output.plural(len(entries), "entry", "entries"),
            escape(shown or "none"),
        )
    return table


@group.command()
@with_target
def prune(
    ctx: typer.Context,
    keep: Annotated[
        int,
        typer.Option(
            "--keep",
            min=0,
            metavar="N",
            help="How many archived runs with a verified checkpoint to keep (the newest).",
        ),
    ],
    yes: Annotated[
        bool, typer.Option("--yes", "-y", help="Delete without asking (for scripts).")
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would be deleted; delete nothing.")
    ] = False,
    *,
    where: TargetChoice,
) -> None:
    """Delete archived runs, keeping the newest N that hold a verified checkpoint. Live
    checkpoints are never touched.

    A run counts among the N kept only if it holds a checkpoint the trainer can resume from
    (its manifest and checksum verified at the place, by the job's python in the current
    release); a run without one (a crash log, a run stopped before its first save) is deleted.
    While the live folder holds no checkpoint (a fresh run has just started), the newest run
    that does is kept whatever N says. Every run is listed with its verdict first, then you
    are asked (--yes: not asked; --dry-run: nothing deleted).

    A run is a folder archive/<UTC time>/ (what deploy and restart --clean create). Anything
    else in archive/ (a symlink, a file, another folder) is not a run: it is left alone and
    named in a warning, never followed. Each deletion first proves, at the place, that the
    entry is such a run inside <checkpoints>/archive/.

    \b
    Examples:
      dflash checkpoints prune --keep 3 --dry-run
      dflash checkpoints prune --keep 3
      dflash checkpoints prune --keep 1 --yes      # in a script
    """
    with workspace(ctx, where) as ws:
        chosen = pruning.plan(ws, keep=keep)
        for message in chosen.skipped:
            output.warn(message)
        if not chosen.verdicts:
            output.info(f"No archived runs in {ws.target.checkpoints}: nothing to delete.")
            return
        output.out.print(_verdicts(chosen))
        doomed = chosen.doomed
        freed = output.size(sum(run.size for run in doomed))
        if not doomed:
            output.success("Nothing to delete.")
            return
        what = f"{output.plural(len(doomed), 'archived run')} ({freed})"
        if dry_run:
            output.info(f"Dry run: would delete {what}; nothing deleted.")
            return
        _confirm(f"Delete {what}?", yes=yes)
        report = pruning.execute(ws, chosen)
    for stamp in report.deleted:
        output.info(f"Deleted archived run {stamp}")
    for message in report.refused:
        output.warn(message)
    output.success(
        f"Deleted {output.plural(len(report.deleted), 'archived run')}; "
        f"kept {len(chosen.kept)}"
        + (f"; refused {len(report.refused)}." if report.refused else ".")
    )
    if report.refused:
        raise typer.Exit(1)


def _verdicts(chosen: PrunePlan) -> Table:
    """One row per archived run, newest first: size, newest verified checkpoint, verdict."""
    table = Table(box=None, pad_edge=False, padding=(0, 2, 0, 0))
    for name, justify in (("archived run", "left"), ("size", "right"), ("checkpoint", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    table.add_column("verdict")
    for verdict in chosen.verdicts:
        run = verdict.run
        action = "[green]keep[/green]" if verdict.keep else "[red]delete[/red]"
        table.add_row(
            escape(run.stamp),
            output.size(run.size),
            escape(run.checkpoint or "none"),
            f"{action}: {escape(verdict.why)}",
        )
    return table


def _confirm(question: str, *, yes: bool) -> None:
    """Go on when `--yes` was given or the user answers yes at a terminal; else NotConfirmed."""
    if yes:
        return
    if not sys.stdin.isatty():
        raise NotConfirmed(
            "Not deleting: nobody to ask (stdin is not a terminal).",
            hint="Pass --yes to delete what is listed above, or --dry-run to only list it.",
        )
    if not typer.confirm(question, default=False, err=True):
        raise NotConfirmed("Nothing deleted (not confirmed).", hint="")
