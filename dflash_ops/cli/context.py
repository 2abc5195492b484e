"""The root options (`--config`, `--verbose`) and how a command gets its Workspace."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import typer

from dflash_ops.config import TargetFlags
from dflash_ops.workspace import Workspace


@dataclass(frozen=True, kw_only=True)
class Globals:
    config: Path | None = None
    verbose: bool = False


@contextmanager
def workspace(
    ctx: typer.Context,
    *,
    target: str | None,
    host: str | None,
    user: str | None,
    port: int | None,
    ct: int | None,
    accept_new_host_key: bool = False,
) -> Iterator[Workspace]:
    """The command's Workspace from the root options and its target flags; closed on exit.

    Every command that acts on a target takes the same six flags (cli/options.py); this is
    the one place they become a `TargetFlags` and the connection is released.
    """
    root = ctx.find_object(Globals) or Globals()
    ws = Workspace.load(
        config_file=root.config,
        flags=TargetFlags(target=target, host=host, user=user, port=port, ct=ct),
        accept_new_host_key=accept_new_host_key,
    )
    try:
        yield ws
    finally:
        ws.close()
