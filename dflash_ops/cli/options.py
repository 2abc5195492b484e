"""Options shared by several commands, declared once.

Every command that acts on a target takes the same selection flags; `target_flags` turns them
into the `TargetFlags` that `config.resolve_target` understands.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dflash_ops.config import TargetFlags

_TARGET = "Target (default: the last deployed from this folder, else [target])"

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="deploy.toml to use (default: $DFLASH_CONFIG, else ./deploy.toml).",
        dir_okay=False,
    ),
]
VerboseOption = Annotated[
    bool, typer.Option("--verbose", "-v", help="Log every step (and show tracebacks of bugs).")
]
TargetOption = Annotated[
    str | None,
    typer.Option(
        "--target", "-t", help="Named target: a [targets.NAME] table.", rich_help_panel=_TARGET
    ),
]
HostOption = Annotated[
    str | None,
    typer.Option(
        "--host",
        "-H",
        help="SSH host (address or ~/.ssh/config alias); makes the place ssh.",
        rich_help_panel=_TARGET,
    ),
]
UserOption = Annotated[
    str | None, typer.Option("--user", "-u", help="SSH user.", rich_help_panel=_TARGET)
]
PortOption = Annotated[
    int | None,
    typer.Option("--port", "-p", help="SSH port.", min=1, max=65535, rich_help_panel=_TARGET),
]
CtOption = Annotated[
    int | None,
    typer.Option(
        "--ct",
        help="Proxmox container id on --host; makes the place proxmox (pct exec).",
        rich_help_panel=_TARGET,
    ),
]
AcceptKeyOption = Annotated[
    bool,
    typer.Option(
        "--accept-new-host-key",
        help="Trust and remember the host key of a host never seen before (shown first).",
        rich_help_panel=_TARGET,
    ),
]


def target_flags(
    *,
    target: str | None,
    host: str | None,
    user: str | None,
    port: int | None,
    ct: int | None,
) -> TargetFlags:
    return TargetFlags(target=target, host=host, user=user, port=port, ct=ct)


ForceOption = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Take over the target's deploy lock even if another dflash command holds it.",
    ),
]
