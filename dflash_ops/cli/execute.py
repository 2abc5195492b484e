"""`dflash exec -- CMD…`: run one command at the place in the job's environment."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from dflash_ops.cli.context import workspace
from dflash_ops.cli.foreground import copy
from dflash_ops.cli.options import TargetChoice, with_target
from dflash_ops.commands import execute
from dflash_ops.untrusted import visible

app = typer.Typer()


@app.command(name="exec")
@with_target
def exec_(
    ctx: typer.Context,
    command: Annotated[
        list[str] | None,
        typer.Argument(metavar="-- CMD", hidden=True),  # the usage line says it
    ] = None,
    *,
    where: TargetChoice,
) -> None:
    """Run a command at the place as the job runs: in the current release's folder, with
    [job] env and the job's own variables (DFLASH_CHECKPOINTS, …), its python first on PATH.

    Its output comes back as it is written (stderr once it ends; on a terminal with control
    characters made visible, piped unchanged) and dflash exits with its exit code; Ctrl-C
    stops it there. Nothing is read from stdin: for a terminal at the job, dflash attach.

    \b
    Examples:
      dflash exec -- python -c "import torch; print(torch.cuda.device_count())"
      dflash exec -- nvidia-smi
      dflash exec --target gpu-box -- ls -la '$DFLASH_CHECKPOINTS'   # no shell: literally
      dflash exec -- bash -c 'du -sh "$DFLASH_CHECKPOINTS"'
    """
    with workspace(ctx, where) as ws:
        stream = execute.start(ws, command or [])
        # piped, its output is data and goes out unchanged; on a terminal, rendered visible
        piped = not sys.stdout.isatty()
        code = copy(stream, what=f"command on {ws.target.describe()}", raw=piped)
    said = stream.stderr
    if sys.stderr.isatty():
        said = visible(said.decode("utf-8", "replace")).encode()
    sys.stderr.buffer.write(said)
    sys.stderr.buffer.flush()
    raise typer.Exit(code)
