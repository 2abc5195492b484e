"""`dflash export`: the drafter as a Hugging Face folder, exported at the place, copied here."""

from __future__ import annotations

import time
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import RenderableType
from rich.progress import (
    DownloadColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TransferSpeedColumn,
)
from rich.text import Text

from dflash_ops.cli import output
from dflash_ops.cli.context import workspace
from dflash_ops.cli.options import CheckpointOption, TargetChoice, with_target
from dflash_ops.commands import export as exporting
from trainer.export import serving

app = typer.Typer()


class Dtype(StrEnum):
    """The weights' dtype in the exported folder (`exporting.DTYPES`)."""

    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


@app.command(name="export")
@with_target
def export(
    ctx: typer.Context,
    to: Annotated[
        Path,
        typer.Option(
            "--to", metavar="DIR", help="Local folder to create (config.json, model.safetensors)."
        ),
    ],
    checkpoint: CheckpointOption = None,
    dtype: Annotated[Dtype, typer.Option("--dtype", help="Weights dtype.")] = Dtype.bf16,
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

    Runs `python -m trainer export` at the place, in the current release with its train.toml,
    the target's python and the [job] env, then streams the folder back over the same
    connection (one tar stream). An interrupted export leaves nothing at --to. How to serve
    it: docs/serving.md.

    \b
    Examples:
      dflash export --to ./drafter
      dflash export --checkpoint step-00002000 --to ./drafter-2000 --dtype fp32
      dflash export --checkpoint 20260102T030405.678Z --to ./drafter  # an archived run
      dflash export --to ./drafter --keep-remote
    """
    request = exporting.ExportRequest(
        to=to, checkpoint=checkpoint, dtype=dtype.value, keep_remote=keep_remote
    )
    tmp = exporting.staging(to)
    try:
        with workspace(ctx, where) as ws:
            stream, kept = exporting.start(ws, request)
            output.info(f"Exporting on {ws.target.describe()} …")
            started = time.monotonic()
            first = None  # when the first bytes came: the export at the place is done by then
            with _progress() as bar:
                task = bar.add_task("exporting at the place …", total=None)
                received = 0

                def on_bytes(n: int) -> None:
                    nonlocal received, first
                    if first is None:
                        first = time.monotonic()
                        bar.update(task, description="receiving")
                    received += n
                    bar.update(task, completed=received)

                folder = exporting.receive(stream, tmp, to, on_bytes=on_bytes)
    except KeyboardInterrupt:
        output.info(f"Interrupted; nothing was written to {to}.")
        raise typer.Exit(130) from None
    finally:
        if tmp.exists():
            exporting.discard(tmp)
    done = time.monotonic()
    first = done if first is None else first
    moving = max(done - first, 1e-9)
    output.success(
        f"Exported to {folder}: {first - started:.1f} s at the place, then "
        f"{output.size(received)} in {moving:.1f} s ({received / 1e6 / moving:.1f} MB/s)"
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


class _Flowing(ProgressColumn):
    """`inner` once bytes flow; nothing before: while the exporter runs at the place there is
    no size and no speed to show (not `0/? bytes` and `0.0 MB/s`)."""

    def __init__(self, inner: ProgressColumn) -> None:
        super().__init__()
        self.inner = inner

    def render(self, task: Task) -> RenderableType:
        return self.inner.render(task) if task.completed else Text("")


def _progress() -> Progress:
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        _Flowing(DownloadColumn()),
        _Flowing(TransferSpeedColumn()),
        TimeElapsedColumn(),
        console=output.err,
        transient=True,
        disable=not output.err.is_terminal,
    )
