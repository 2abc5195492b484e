"""`dflash status`: is the job running, since when, on which release, and how is it doing —
down to each GPU of the place: its role in the split, utilisation and memory."""

from __future__ import annotations

import datetime as dt
import json
from typing import Annotated, Any

import typer
from rich.markup import escape
from rich.table import Table

from dflash_ops.cli import output
from dflash_ops.cli.context import never_deployed_hint, workspace
from dflash_ops.cli.options import (
    TargetChoice,
    with_target,
)
from dflash_ops.commands import operations
from dflash_ops.untrusted import more

app = typer.Typer()


@app.command()
@with_target
def status(
    ctx: typer.Context,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print one JSON object (for scripts).")
    ] = False,
    lines: Annotated[
        int,
        typer.Option("--lines", "-n", metavar="N", min=0, help="How many last log lines to show."),
    ] = 10,
    *,
    where: TargetChoice,
) -> None:
    """Show whether the job runs (or its exit code), since when, the release, the last log
    lines, the latest loss and throughput the trainer logged, its last τ probe (held out, on
    training prompts, prompt lookup's; with a warning when the drafter memorises its training
    data), and one line per GPU of the place
    (role, utilisation and memory from nvidia-smi, torch's memory of the rank on it), with each
    role's tokens/s, waiting share and the batches in flight of a target/drafter split.

    \b
    Examples:
      dflash status
      dflash status --json | jq .running
    """
    with workspace(ctx, where) as ws:
        report = operations.status(ws, lines=lines)
        hint = None if report["exists"] or report["deployed_here"] else never_deployed_hint(ws)
    if as_json:
        output.out.print_json(json.dumps(report)) if output.out.is_terminal else print(
            json.dumps(report)
        )
        return
    _print_human(report, hint)


def _print_human(report: dict[str, Any], hint: str | None) -> None:
    say = output.out.print
    say(f"[bold]target[/bold]   {escape(report['target'])} ({escape(report['place'])})")
    if report["running"]:
        job = f"[green]running[/green] since {_when(report['started_at'])}"
    elif report["exists"]:
        code = report["exit_code"]
        colour = "green" if code == 0 else "red"
        job = (
            f"[{colour}]exited with code {code}[/{colour}] (started {_when(report['started_at'])})"
        )
    elif not report.get("deployed_here", True):
        job = "[yellow]none[/yellow]: no job deployed from here"
    else:
        job = "[yellow]not running[/yellow] (no session)"
    say(f"[bold]job[/bold]      {escape(report['session'])}: {job}")
    if hint is not None:
        output.hint(hint)
    say(f"[bold]release[/bold]  {escape(report['release'] or 'none deployed')}")
    running = report.get("job_release")
    if running and report["running"] and running != report["release"]:
        output.warn(
            f"release {report['release'] or 'none'} is current, the job still runs release "
            f"{running}"
        )
        output.hint("Run dflash restart to run the current release (or dflash rollback).")
    metrics = report["metrics"]
    if metrics:
        say(f"[bold]metrics[/bold]  {output.message(_metrics(metrics))}")
        probe = metrics.get("probe")
        if isinstance(probe, dict):
            say(f"[bold]tau[/bold]      {output.message(_probe(probe))}")
            if probe.get("warning"):
                say(f"[bold yellow]warning[/bold yellow]  {output.message(str(probe['warning']))}")
    if report.get("split"):
        say(f"[bold]split[/bold]    {output.message(_split(report['split']))}")
    if report.get("gpus") is not None:
        say("[bold]gpus[/bold]")
        say(_gpu_table(report["gpus"]))
    elif report.get("gpu_note"):
        say(f"[bold]gpus[/bold]     [dim]{output.message(report['gpu_note'])}[/dim]")
    say(f"[bold]log[/bold]      {escape(report['log'])}")
    if report.get("log_cut"):
        say(f"  [dim]{more(report['log_cut'])} before these lines[/dim]")
    for line in report["last_lines"]:
        say(f"  {output.message(line)}")


def _when(iso: str | None) -> str:
    if iso is None:
        return "?"
    started = dt.datetime.fromisoformat(iso)
    seconds = int((dt.datetime.now(dt.UTC) - started).total_seconds())
    ago = (
        f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
        if seconds >= 3600
        else f"{seconds // 60}m{seconds % 60:02d}s"
    )
    return f"{started:%Y-%m-%d %H:%M:%S} UTC ({ago} ago)"


def _metrics(metrics: dict[str, Any]) -> str:
    parts = []
    if "step" in metrics:
        parts.append(f"step {metrics['step']}")
    if isinstance(metrics.get("loss"), (int, float)):
        parts.append(f"loss {metrics['loss']:.4f}")
    if isinstance(metrics.get("tokens_per_s"), (int, float)):
        parts.append(f"{metrics['tokens_per_s']:,.0f} tokens/s")
    return " · ".join(parts) or json.dumps(metrics)


def _probe(probe: dict[str, Any]) -> str:
    """The trainer's last τ probe: held out, on training prompts, prompt lookup's."""
    interval = probe.get("tau_interval")
    spread = ""
    if isinstance(interval, list) and len(interval) == 2:
        spread = f" (95% {_tau(interval[0])}–{_tau(interval[1])})"
    parts = [f"{_tau(probe.get('tau'))}{spread} held out"]
    if probe.get("tau_train") is not None:
        parts.append(f"{_tau(probe['tau_train'])} on training prompts")
    if probe.get("tau_prompt_lookup") is not None:
        parts.append(f"prompt lookup {_tau(probe['tau_prompt_lookup'])}")
    return " · ".join(parts) + f" (step {probe.get('step', '?')})"


def _tau(value: object) -> str:
    return f"{value:.2f}" if isinstance(value, (int, float)) else "?"


def _split(split: dict[str, Any]) -> str:
    parts = []
    for role, values in split["roles"].items():
        if isinstance(values, dict):
            parts.append(
                f"{role} ×{values.get('ranks', '?')} {_num(values.get('tokens_per_s'))} tokens/s, "
                f"waiting {_pct(values.get('wait_frac'))}"
            )
    if split.get("in_flight") is not None:
        parts.append(f"{split['in_flight']} batches in flight")
    return " · ".join(parts)


def _gpu_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(box=None, pad_edge=False, padding=(0, 2, 0, 2), show_edge=False)
    for name in ("gpu", "role", "ranks", "util"):
        table.add_column(name, justify="left" if name == "role" else "right")
    table.add_column("memory used / total", justify="right")
    table.add_column("torch GiB", justify="right")
    for row in rows:
        used, total = row["mem_used_mib"], row["mem_total_mib"]
        memory = f"{_num(used)} / {_num(total)} MiB"
        if isinstance(used, (int, float)) and isinstance(total, (int, float)) and total > 0:
            memory += f" ({100 * used / total:.0f}%)"
        ranks = ",".join(str(r) for r in row["ranks"]) or "—"
        util = row["util_pct"]
        table.add_row(
            str(row["index"]),
            escape(row["role"]),
            ranks,
            "?" if util is None else f"{util:.0f}%",
            memory,
            "—" if row["mem_gib"] is None else f"{row['mem_gib']:.1f}",
        )
    return table


def _num(value: object) -> str:
    return f"{value:,.0f}" if isinstance(value, (int, float)) else "?"


def _pct(value: object) -> str:
    return f"{100 * value:.0f}%" if isinstance(value, (int, float)) else "?"
