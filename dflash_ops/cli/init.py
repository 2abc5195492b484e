"""`dflash init`: write a commented deploy.toml for the place named on the command line."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import typer

from dflash_ops.cli import output
from dflash_ops.cli.context import Globals, command
from dflash_ops.cli.options import (
    AcceptKeyOption,
    CtOption,
    HostOption,
    PortOption,
    UserOption,
    check_ct,
)
from dflash_ops.commands import init as init_lib
from dflash_ops.commands.workspace import open_place
from dflash_ops.errors import ConfigError, DflashError
from dflash_ops.settings import project as projects
from dflash_ops.settings.deploy_config import DEFAULT_CONFIG_NAME, Target

app = typer.Typer()


@app.command("init")
def init_command(
    ctx: typer.Context,
    host: HostOption = None,
    user: UserOption = None,
    port: PortOption = None,
    ct: CtOption = None,
    model: Annotated[
        str | None,
        typer.Option(
            "--model",
            "-m",
            metavar="PATH",
            help="Target model folder at the place (save_pretrained layout); default: the demo.",
        ),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option(
            "--data",
            "-d",
            metavar="PATH",
            help="Training data at the place: chat ({'messages'}), text ({'text'}) or tokenized "
            "JSONL (with --model).",
        ),
    ] = None,
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing deploy.toml.")
    ] = False,
    accept_new_host_key: AcceptKeyOption = False,
) -> None:
    """Write a commented deploy.toml for this machine, an SSH host (--host) or a Proxmox
    container (--host --ct), with the GPU count read from the place (nvidia-smi).

    The file goes to --config FILE if given, else ./deploy.toml; an existing file is only
    replaced with --force.

    \b
    Examples:
      dflash init                                   # this machine, the demo target
      dflash init --host gpu-box --model /models/Qwen3-8B --data /data/chat.jsonl
      dflash init --host pve --ct 200 --force
    """
    root = ctx.find_object(Globals) or Globals()
    path = (root.config or Path(DEFAULT_CONFIG_NAME)).expanduser().absolute()
    init_lib.check_target_file(path, force=force)  # before connecting anywhere
    check_ct(ct)
    if ct is not None and host is None:
        raise ConfigError(
            "--ct needs --host: the container lives on a Proxmox node.",
            hint="Name the node as well: dflash init --host <proxmox node> --ct <id>",
        )
    if data is not None and model is None:
        raise ConfigError(
            "--data needs --model: the demo builds its own target and data.",
            hint="Pass --model /path/to/target --data /path/to/train.jsonl.",
        )
    place_kind = "local" if host is None else "ssh" if ct is None else "proxmox"
    target = Target(  # only the connection fields matter: it is used to ask for the GPUs
        name="init",
        place=place_kind,
        host=host,
        user=user,
        port=port,
        ct=ct,
        root="/",
        checkpoints="/",
        python="python3",
    )
    gpus = _gpus(target, accept_new_host_key=accept_new_host_key)
    plan = init_lib.InitPlan(
        place=place_kind,
        host=host,
        user=user,
        port=port,
        ct=ct,
        gpus=gpus,
        model=model,
        data=data,
    )
    if place_kind != "local":
        own = projects.load(path.parent)
        plan = dataclasses.replace(
            plan, remote_root=own.remote_root, remote_checkpoints=own.remote_checkpoints
        )
    init_lib.write(path, init_lib.render(plan), force=force)
    counted = output.plural(gpus.count, "GPU") if gpus.counted else "GPUs NOT COUNTED (gpus = 0)"
    split = ", split by the trainer from the model shapes" if gpus.count > 1 else ""
    output.success(f"Wrote {path}: {place_kind} place, {counted}{split}.")
    if not gpus.counted:
        output.warn(
            f"The GPUs of {target.describe()} were not counted ({gpus.note}): [job] gpus = 0 "
            f"makes the job train on the CPU. Set gpus under [job] in {path} to the GPUs "
            f"there, or run {command(ctx, 'init', '--force', *_place_args(host, user, port, ct))} "
            "again once the place answers."
        )
    if model is not None and data is None:
        output.warn(
            f'data.path is not set: add path = "/data/train.jsonl" under [train.data] in {path} '
            "(chat, text or tokenized JSONL at the place), or run init again with --data."
        )
    output.info(f"Next: {command(ctx, 'doctor')}, then {command(ctx, 'deploy')}.")


def _gpus(target: Target, *, accept_new_host_key: bool) -> init_lib.GpuInfo:
    """The place's GPUs; when the place cannot be asked, 0 with a warning saying why."""
    place = open_place(target, accept_new_host_key=accept_new_host_key)
    try:
        place.ensure_ready()
        return init_lib.count_gpus(place)
    except DflashError as exc:
        output.warn(f"Could not read the GPU count from {target.describe()}: {exc}")
        if exc.hint:
            output.hint(exc.hint)
        return init_lib.GpuInfo(count=0, note="the place did not answer", counted=False)
    finally:
        place.close()


def _place_args(host: str | None, user: str | None, port: int | None, ct: int | None) -> list[str]:
    """The place flags as given, to repeat them in a hint."""
    named = {"--host": host, "--user": user, "--port": port, "--ct": ct}
    return [
        word for flag, value in named.items() if value is not None for word in (flag, str(value))
    ]
