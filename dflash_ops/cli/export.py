"""`dflash export`: the drafter as a Hugging Face folder, exported at the place, copied here."""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from dflash_ops.cli import output
from dflash_ops.cli.context import workspace
from dflash_ops.cli.options import CheckpointOption, TargetChoice, with_target
from dflash_ops.commands import export as exporting
from trainer import serving

app = typer.Typer()


@app.command(name="export")
@with_target
def export(
    ctx: typer.Context,
    to: Annotated[
        Path, typer.Option("--to", help="Local folder to create (config.json, model.safetensors).")
    ],
    checkpoint: CheckpointOption = None,
    dtype: Annotated[
        str, typer.Option("--dtype", help="Weights dtype: bf16, fp16 or fp32.")
    ] = "bf16",
    keep_remote: Annotated[
        bool,
        typer.Option(
            "--keep-remote", help="Also leave the folder at the place, in <checkpoints>/exports/."
        ),
    ] = False,
    *,
    where: TargetChoice,
) -> None:
    """Export the drafter for SGLang, vLLM or the reference DFlashDraftModel, and copy it here.

    Runs `python -m trainer.export` at the place, in the current release with its train.toml,
    the target's python and the [job] env, then streams the folder back over the same
    connection (one tar stream). An interrupted export leaves nothing at --to. How to serve
    it: docs/serving.md.

    \b
    Examples:
      dflash export --to ./drafter
      dflash export --checkpoint step-00002000 --to ./drafter-2000 --dtype fp32
      dflash export --to ./drafter --keep-remote
    """
    request = exporting.ExportRequest(
        to=to, checkpoint=checkpoint, dtype=dtype, keep_remote=keep_remote
    )
    tmp = exporting.staging(to)
    try:
        with workspace(ctx, where) as ws:
            stream, kept = exporting.start(ws, request)
            output.info(f"Exporting on {ws.target.describe()} …")
            started = time.monotonic()
            with _progress() as bar:
                task = bar.add_task("receiving", total=None)
                received = 0

                def on_bytes(n: int) -> None:
                    nonlocal received
                    received += n
                    bar.update(task, completed=received)

                folder = exporting.receive(stream, tmp, to, on_bytes=on_bytes)
    except KeyboardInterrupt:
        output.info(f"Interrupted; nothing was written to {to}.")
        raise typer.Exit(130) from None
    finally:
        if tmp.exists():
            exporting.discard(tmp)
    seconds = max(time.monotonic() - started, 1e-9)
    output.success(
        f"Exported to {folder} ({received / 1e6:.1f} MB in {seconds:.1f} s, "
        f"{received / 1e6 / seconds:.1f} MB/s)"
    )
    if kept is not None:
        output.info(f"A copy stays at the place: {kept}")
    output.info(serving.describe(folder, _target(ws.config.train)))


def _target(train: Mapping[str, Any]) -> str | None:
    """`[train.model] target` as `deploy.toml` writes it; None for the demo (it builds its own)."""
    model, demo = train.get("model"), train.get("demo")
    if demo is True or (isinstance(demo, Mapping) and demo.get("enabled") is True):
        return None
    target = model.get("target") if isinstance(model, Mapping) else None
    return target if isinstance(target, str) else None


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=output.err,
        transient=True,
        disable=not output.err.is_terminal,
    )
