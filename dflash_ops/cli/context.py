"""The root options (`--config`, `--verbose`) and how a command gets its Workspace."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from dflash_ops.config import TargetFlags
from dflash_ops.workspace import Workspace


@dataclass(frozen=True, kw_only=True)
class Globals:
    config: Path | None = None
    verbose: bool = False


def workspace(
    ctx: typer.Context, flags: TargetFlags, *, accept_new_host_key: bool = False
) -> Workspace:
    root = ctx.find_object(Globals) or Globals()
    return Workspace.load(
        config_file=root.config, flags=flags, accept_new_host_key=accept_new_host_key
    )
