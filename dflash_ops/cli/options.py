"""Options shared by several commands, declared once.

Every command that acts on a target takes the same six selection flags. They are declared once
here and added to a command by `with_target`, which hands the command one `TargetChoice`;
`context.workspace` turns that into the Workspace of the target.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from dflash_ops.connect.shell import CONTAINER_IDS
from dflash_ops.errors import ConfigError
from dflash_ops.settings.deploy_config import TargetFlags

_TARGET = "Target (default: the last deployed from this folder, else [target])"

ConfigOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        metavar="FILE",
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
        "--target",
        "-t",
        metavar="NAME",
        help="Named target: a [targets.NAME] table.",
        rich_help_panel=_TARGET,
    ),
]
HostOption = Annotated[
    str | None,
    typer.Option(
        "--host",
        "-H",
        metavar="HOST",
        help="SSH host (address or ~/.ssh/config alias); makes the place ssh.",
        rich_help_panel=_TARGET,
    ),
]
UserOption = Annotated[
    str | None,
    typer.Option("--user", "-u", metavar="USER", help="SSH user.", rich_help_panel=_TARGET),
]
PortOption = Annotated[
    int | None,
    typer.Option(
        "--port", "-p", metavar="PORT", help="SSH port.", min=1, max=65535, rich_help_panel=_TARGET
    ),
]
CtOption = Annotated[
    int | None,
    typer.Option(
        "--ct",
        metavar="CT",
        help=f"Proxmox container id on --host, {CONTAINER_IDS[0]}-{CONTAINER_IDS[1]} (pct list "
        "there shows them); makes the place proxmox (pct exec).",
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

NoWaitOption = Annotated[
    bool,
    typer.Option(
        "--no-wait",
        help="Do not wait for the job to be past start-up ([job] start_wait seconds at most).",
    ),
]

CheckpointOption = Annotated[
    str | None,
    typer.Option(
        "--checkpoint",
        metavar="NAME",
        help="step-XXXXXXXX in the checkpoints folder, an archived run's UTC time (its newest "
        "verified checkpoint; dflash checkpoints lists them), or an absolute path at the place "
        "(default: the newest verified checkpoint of the live folder).",
    ),
]


@dataclass(frozen=True, kw_only=True)
class TargetChoice:
    """What one command line said about its target: the flags that pick it, and whether an
    unknown host key may be trusted on first use (kept apart: it is a permission, not a pick)."""

    flags: TargetFlags
    accept_new_host_key: bool = False


_KW = inspect.Parameter.KEYWORD_ONLY
_TARGET_FLAGS = (
    inspect.Parameter("target", _KW, default=None, annotation=TargetOption),
    inspect.Parameter("host", _KW, default=None, annotation=HostOption),
    inspect.Parameter("user", _KW, default=None, annotation=UserOption),
    inspect.Parameter("port", _KW, default=None, annotation=PortOption),
    inspect.Parameter("ct", _KW, default=None, annotation=CtOption),
    inspect.Parameter("accept_new_host_key", _KW, default=False, annotation=AcceptKeyOption),
)

R = TypeVar("R")


def with_target(command: Callable[..., R]) -> Callable[..., R]:
    """Give `command` the six target flags in place of its keyword-only `where: TargetChoice`.

    Typer builds a command's options from `inspect.signature(f, eval_str=True)` and
    `typing.get_type_hints(f)`, so the wrapper carries a `__signature__` in which `where` is
    replaced, at its position (which fixes where the flags stand in --help), by the six flags,
    with their annotations as objects (the command modules' own annotations are strings under
    `from __future__ import annotations`, resolved here against the command's module). Called
    with the flags as keywords, the wrapper folds them into one TargetChoice. Apply it under
    `@app.command()`.
    """
    signature = inspect.signature(command, eval_str=True)
    where = signature.parameters.get("where")
    if where is None or where.kind is not _KW:
        raise TypeError(f"{command.__qualname__} needs a keyword-only `where: TargetChoice`")
    clash = {p.name for p in _TARGET_FLAGS} & set(signature.parameters)
    if clash:
        raise TypeError(f"{command.__qualname__} already has target flags: {sorted(clash)}")
    params = list(signature.parameters.values())
    at = params.index(where)
    params[at : at + 1] = _TARGET_FLAGS

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> R:
        given = {p.name: kwargs.pop(p.name, p.default) for p in _TARGET_FLAGS}
        check_ct(given["ct"])
        accept = given.pop("accept_new_host_key")
        choice = TargetChoice(flags=TargetFlags(**given), accept_new_host_key=accept)
        return command(*args, where=choice, **kwargs)

    # functools.wraps shares the command's __annotations__ dict: give the wrapper its own.
    annotations = {p.name: p.annotation for p in params if p.annotation is not p.empty}
    if signature.return_annotation is not signature.empty:
        annotations["return"] = signature.return_annotation
    wrapper.__annotations__ = annotations
    wrapper.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    return wrapper


def check_ct(ct: int | None) -> None:
    """`--ct` must be a Proxmox container id: said about the flag, before anything else."""
    low, high = CONTAINER_IDS
    if ct is not None and not low <= ct <= high:
        raise ConfigError(
            f"--ct {ct} is not a container id: Proxmox numbers containers {low} to {high}.",
            hint="Pass the id that pct list shows on the Proxmox node, e.g. --ct 200.",
        )
