"""The root options (`--config`, `--verbose`) and how a command gets its Workspace."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import typer

from dflash_ops.cli import output
from dflash_ops.cli.options import TargetChoice
from dflash_ops.commands.workspace import Workspace


@dataclass(frozen=True, kw_only=True)
class Globals:
    config: Path | None = None
    verbose: bool = False


def command(ctx: typer.Context, *args: str) -> str:
    """`dflash ARGS…` as the user should type it next: with `--config FILE` when this command
    was given one (a hint without it would act on another deploy.toml)."""
    from dflash_ops.connect.shell import quote_argv

    root = ctx.find_object(Globals) or Globals()
    config = ["--config", str(root.config)] if root.config is not None else []
    return quote_argv(["dflash", *config, *args])


@contextmanager
def workspace(ctx: typer.Context, where: TargetChoice) -> Iterator[Workspace]:
    """The command's Workspace from the root options and its target choice; closed on exit.

    Every command that acts on a target gets the same flags as one TargetChoice
    (`options.with_target`); this is the one place the connection is opened and released.
    """
    root = ctx.find_object(Globals) or Globals()
    ws = Workspace.load(
        config_file=root.config,
        flags=where.flags,
        accept_new_host_key=where.accept_new_host_key,
    )
    if where.flags.selects and ws.target.note:  # said once, when the flags are typed
        output.info(f"note: {ws.target.note}")
    try:
        yield ws
    finally:
        ws.close()
