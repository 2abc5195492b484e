"""`dflash init`: write a commented deploy.toml for a place, with its GPU count read from it.

The GPU count comes from `nvidia-smi --query-gpu=name --format=csv,noheader` run at the place
(inside the container for a Proxmox target); no `nvidia-smi` means 0 GPUs. `target_gpus = 0` is
written whatever the count: the trainer then picks the split between the target model and the
drafter from the model shapes it reads at start (`trainer.split.split_shapes`), which no file written
before the model is there can know; with 0 or 1 GPU everything is colocated.

An existing file is never replaced unless asked (`force=True`).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from dflash_ops.connect.place import Place
from dflash_ops.errors import ConfigError

NVIDIA_SMI = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]


@dataclass(frozen=True, kw_only=True)
class GpuInfo:
    count: int
    names: tuple[str, ...] = ()
    note: str = ""  # why the count is 0 or unknown
    counted: bool = True  # False: the place could not be asked, or nvidia-smi failed there


@dataclass(frozen=True, kw_only=True)
class InitPlan:
    """What the written file says: where the job runs, how many GPUs, which target model."""

    place: str  # "local" | "ssh" | "proxmox"
    host: str | None = None
    user: str | None = None
    port: int | None = None
    ct: int | None = None
    gpus: GpuInfo
    model: str | None = None
    data: str | None = None  # training data at the place (with `model`)
    remote_root: str = "/root/dflash/<project>"  # this folder's defaults at a remote place
    remote_checkpoints: str = "/workspace/dflash/<project>"


def count_gpus(place: Place) -> GpuInfo:
    """`nvidia-smi --query-gpu=name --format=csv,noheader` at the place: one line per GPU."""
    result = place.run(NVIDIA_SMI, check=False, timeout=60)
    if result.exit_code == 127:
        return GpuInfo(count=0, note=f"no nvidia-smi on {place.description}")
    if result.exit_code != 0:
        last = (
            result.stderr_text.strip().splitlines()[-1:]
            or result.stdout_text.strip().splitlines()[-1:]
        )
        return GpuInfo(count=0, note=f"nvidia-smi failed: {(last or ['?'])[0]}", counted=False)
    names = tuple(line.strip() for line in result.stdout_text.splitlines() if line.strip())
    return GpuInfo(count=len(names), names=names)


def _toml_str(value: str) -> str:
    return json.dumps(value, ensure_ascii=False)  # a JSON string is a valid TOML basic string


def _line(setting: str, comment: str = "") -> str:
    """`setting` with its comment aligned in one column."""
    return f"{setting:<33} # {comment}" if comment else setting


def render(plan: InitPlan) -> str:
    """The text of deploy.toml: every setting present or commented, with what it means."""
    g = plan.gpus
    names = ", ".join(sorted(set(g.names)))
    found = f"{g.count} × {names}" if g.names else f"none ({g.note or 'nvidia-smi lists none'})"
    lines = [
        "# deploy.toml: where the DFlash trainer runs and how. Written by `dflash init`.",
        "# Check it with `dflash doctor`, then run `dflash deploy` and `dflash logs --follow`.",
        "",
        _line("[target]", "used when no --target/--host is given"),
        _line(f"place = {_toml_str(plan.place)}", '"local" | "ssh" | "proxmox"'),
    ]
    if plan.place == "local":
        lines += [
            _line('# root = ".dflash/local"', "releases/ and current/ (relative to this file)"),
            _line('# checkpoints = ".dflash/local/checkpoints"'),
            _line(
                '# python = "python3"', "the job's interpreter (default: the one running dflash)"
            ),
        ]
    else:
        lines += [
            _line(f"host = {_toml_str(plan.host or '')}", "address or ~/.ssh/config alias"),
            f"user = {_toml_str(plan.user)}" if plan.user else '# user = "root"',
            f"port = {plan.port}" if plan.port else "# port = 22",
        ]
        if plan.place == "proxmox":
            lines.append(_line(f"ct = {plan.ct}", "the LXC container, reached with pct exec"))
        lines += [
            _line(
                f"# root = {_toml_str(plan.remote_root)}", "this folder's own: releases/, current"
            ),
            _line(f"# checkpoints = {_toml_str(plan.remote_checkpoints)}"),
            _line('# python = "python3"', "the job's interpreter at that place"),
        ]
    lines += [
        "",
        _line("# [targets.other]", "more places: dflash deploy --target other"),
        '# place = "ssh"',
        '# host = "gpu-box"',
        "",
        "[job]",
        _line('session = "dflash"', "tmux session name"),
        _line('log = "train_stdout.log"', "relative to checkpoints"),
        'env = { PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True" }',
        *_gpus_lines(g, found),
    ]
    if g.count > 1:
        lines += [
            "# 0: the trainer picks the split from the model shapes (logged as the job starts;",
            "# `dflash plan` measures every split on the node)",
            _line("target_gpus = 0", "or N: N GPUs serve the target, the rest train"),
        ]
    else:
        lines.append(_line("target_gpus = 0", "0: target and drafter share the GPU (colocated)"))
    lines += [
        _line('# command = "..."', "replaces the trainer launch; run by bash in current/"),
        "",
        _line("# [venv]", "the job's python as a venv built there: dflash setup"),
        _line('# torch_index = "https://download.pytorch.org/whl/cu128"', "CUDA torch"),
        _line('# wheels = "/srv/wheels"', "or, offline: every wheel from there"),
        "",
        _line("[train]", "the trainer's settings (see docs/training.md)"),
    ]
    if plan.model:
        lines += [
            "",
            "[train.model]",
            _line(f"target = {_toml_str(plan.model)}", "save_pretrained folder at the place"),
            "",
            "[train.data]",
        ]
        if plan.data:
            lines.append(_line(f"path = {_toml_str(plan.data)}", _DATA_COMMENT))
        else:
            lines += [
                "# data.path is required: the check (dflash doctor, every deploy) refuses",
                "# the config until it is set.",
                _line('# path = "/data/chat.jsonl"', _DATA_COMMENT),
            ]
        lines.append(_line("# enable_thinking = false", "chat template option, as served"))
    else:
        lines += [
            _line("demo = true", "a tiny random target built on the spot"),
            "",
            _line("# [train.model]", "a real target instead of the demo (remove demo):"),
            _line('# target = "/models/Qwen3-8B"', "save_pretrained folder at the place"),
        ]
    return "\n".join(lines) + "\n"


_DATA_COMMENT = "chat, text or tokenized JSONL at the place"


def _gpus_lines(g: GpuInfo, found: str) -> list[str]:
    """`gpus = N` with what was found; when nothing could be counted, said above it in capitals
    (0 is then a guess that makes the job train on the CPU)."""
    if g.counted:
        return [_line(f"gpus = {g.count}", f"found at the place: {found}")]
    return [
        f"# GPUS NOT COUNTED: {g.note}. 0 trains on the CPU: set the GPUs the place has",
        "# (dflash doctor counts them; deploy warns while gpus = 0 leaves GPUs idle).",
        _line("gpus = 0", "NOT COUNTED"),
    ]


def check_target_file(path: Path, *, force: bool = False) -> None:
    """Refuse a folder, and an existing file unless `force` (checked before asking the place)."""
    if path.is_dir():
        raise ConfigError(f"{path} is a folder.", hint="Pass --config FILE naming a file.")
    if path.exists() and not force:
        raise ConfigError(
            f"{path} already exists; not overwriting it.",
            hint="Pass --force to replace it, or --config OTHER.toml to write another file.",
        )


def write(path: Path, text: str, *, force: bool = False) -> None:
    """Write `text` to `path` atomically; refuse to replace an existing file without `force`."""
    check_target_file(path, force=force)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
