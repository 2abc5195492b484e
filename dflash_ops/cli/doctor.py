"""`dflash doctor`: check the target before a run, each line passed or failed with the fix."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.markup import escape

from dflash_ops.cli import output
from dflash_ops.cli.context import command, workspace
from dflash_ops.cli.options import (
    TargetChoice,
    with_target,
)
from dflash_ops.commands import doctor
from dflash_ops.commands.workspace import open_place

app = typer.Typer()


@app.command("doctor")
@with_target
def doctor_command(
    ctx: typer.Context,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (for scripts).")
    ] = False,
    gpu_smoke: Annotated[
        bool,
        typer.Option(
            "--gpu-smoke/--no-gpu-smoke",
            help="Run the smoke test of compiled attention + loss at the place (~10 s on a GPU).",
        ),
    ] = True,
    min_free_gib: Annotated[
        float,
        typer.Option(
            "--min-free-gib", metavar="GIB", min=0, help="Free space the checkpoints folder needs."
        ),
    ] = doctor.DEFAULT_MIN_FREE_GIB,
    *,
    where: TargetChoice,
) -> None:
    """Check the target before a run: SSH, container, tmux, python, torch, CUDA and the GPU
    count, the checkpoints folder, the target model, and a GPU smoke test at the place.

    Each line is passed, failed (with the fix to apply), skipped (an earlier check it needs
    failed), or passed with a warning and its fix (e.g. GPUs at the place that a job of
    [job] gpus = 0 leaves idle). The exit code is 0 only when every check passes.

    \b
    Examples:
      dflash doctor                           # [target] from deploy.toml
      dflash doctor --host pve --ct 200       # container 200 on a Proxmox node
      dflash doctor --no-gpu-smoke --json | jq '.checks[] | select(.ok | not)'
    """
    with workspace(ctx, where) as ws:
        place = open_place(ws.target, accept_new_host_key=where.accept_new_host_key)
        show = None if as_json else _print_check
        if not as_json:
            output.info(f"Checking {ws.target.describe()} (target {ws.target.name!r}):")
        try:
            checks = doctor.diagnose(
                doctor.Setup.of(ws, min_free_gib=min_free_gib),
                place,
                gpu_smoke=gpu_smoke,
                on_check=show,
            )
        finally:
            place.close()
        ok = doctor.all_ok(checks)
        if as_json:
            report = {
                "target": ws.target.name,
                "place": ws.target.describe(),
                "ok": ok,
                "checks": [c.to_json() for c in checks],
            }
            print(json.dumps(report))
        elif ok:
            warned = sum(1 for c in checks if c.warning)
            output.success(
                f"All {len(checks)} checks passed"
                + (f"; {output.plural(warned, 'warning')} above." if warned else ".")
            )
        else:
            bad = sum(1 for c in checks if not c.ok and not c.skipped)
            output.info(
                f"{output.plural(bad, 'check')} failed; apply the fixes above and run "
                f"{command(ctx, 'doctor')} again."
            )
        if not ok:
            raise typer.Exit(1)


def _print_check(check: doctor.Check) -> None:
    say = output.out.print
    if check.warning:
        say(
            f"[bold yellow]![/bold yellow] {escape(check.name)}: "
            f"[yellow]{output.message(check.detail)}[/yellow]"
        )
        say(f"    [cyan]fix:[/cyan] {output.message(check.fix)}")
    elif check.ok:
        say(f"[green]✓[/green] {escape(check.name)}: {output.message(check.detail)}")
    elif check.skipped:
        say(f"[yellow]-[/yellow] {escape(check.name)}: {output.message(check.detail)}")
    else:
        say(f"[red]✗[/red] {escape(check.name)}: {output.message(check.detail)}")
        if check.fix:
            say(f"    [cyan]fix:[/cyan] {output.message(check.fix)}")
