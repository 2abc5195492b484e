"""Options shared by several commands, declared once.

Every command that acts on a target takes the same selection flags; `context.workspace` turns
them into the Workspace of that target.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

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


ForceOption = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Take over the target's deploy lock even if another dflash command holds it.",
    ),
]
