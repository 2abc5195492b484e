"""The root options (`--config`, `--verbose`) and how a command gets its Workspace."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import typer

from dflash_ops.cli import output
from dflash_ops.cli.options import TargetChoice
from dflash_ops.commands.workspace import Workspace
from dflash_ops.settings import project as projects


@dataclass(frozen=True, kw_only=True)
class Globals:
    config: Path | None = None
    verbose: bool = False


def command(ctx: typer.Context, *args: str) -> str:
    """`dflash ARGS…` as the user should type it next: with `--config FILE` when this command
    was given one (a hint without it would act on another deploy.toml), and as `program` names
    the command."""
    from dflash_ops.connect.shell import quote_argv

    root = ctx.find_object(Globals) or Globals()
    config = ["--config", str(root.config)] if root.config is not None else []
    return quote_argv([program(), *config, *args])


def program() -> str:
    """How the user can run this command again: `dflash` when that name on PATH is this very
    script, else the script's path (`.venv/bin/dflash` after `make run`, whose venv is not
    activated). Run as `python -m dflash_ops`, it is the command's name, `dflash`."""
    script = Path(sys.argv[0])
    if script.name != "dflash":
        return "dflash"
    found = shutil.which("dflash")
    if found is not None and Path(found).resolve() == script.resolve():
        return "dflash"
    try:
        return f"./{script.resolve().relative_to(Path.cwd().resolve())}"
    except ValueError:
        return str(script.resolve())


def not_on_path() -> str | None:
    """When `dflash` is not on PATH (`program` is a path): how to put it there."""
    name = program()
    if name == "dflash":
        return None
    activate = Path(name).with_name("activate")
    return f"dflash is not on your PATH: `source {activate}` puts it there for this shell."


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


def never_deployed_hint(ws: Workspace) -> str:
    """The hint after "No job deployed from here": deploy from this folder, or — when a job of
    an earlier dflash runs in the root every project shared then — how to reach that one."""
    if not ws.shared_root_job():
        return output.NEVER_DEPLOYED_HINT
    return (
        f"A job deployed by an earlier dflash runs in {projects.LEGACY_ROOT} there, the root "
        f'every project shared then. If it is this project\'s, set root = "{projects.LEGACY_ROOT}" '
        f'and checkpoints = "{projects.LEGACY_CHECKPOINTS}" in the target\'s table of '
        f"{ws.config.path}; otherwise deploy from this folder: dflash deploy."
    )


def shared_root_notice(ws: Workspace) -> str:
    """Said by deploy while this folder's job lives in the root every project shared before
    each got its own: what that means, and how to move it or keep it."""
    own = ws.project
    return (
        f"This project's job lives in {ws.target.root} on {ws.target.describe()}, the root every "
        "project shared before dflash gave each its own: another folder deployed there by an "
        "earlier dflash stops and replaces this job. To give it its own: dflash stop, then set "
        f'root = "{projects.ROOTS}/{own.id}" and checkpoints = "{projects.CHECKPOINTS}/{own.id}" '
        f"in the target's table of {ws.config.path} (move the checkpoints there to resume); to "
        f'keep it and silence this note, set root = "{ws.target.root}" there.'
    )
