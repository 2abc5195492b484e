"""`deploy.toml` → typed, validated settings, and the choice of target for one command.

The file is found as `--config FILE`, else `$DFLASH_CONFIG`, else `./deploy.toml`, and checked
once against its models (`schema.DeployFile`); an unknown key or a wrong type is a `ConfigError`
that names the key and the file, because a typo silently ignored is a multi-day run started with
the wrong settings.

    [target]            where the job runs when nothing else selects a target (`schema.py`)
    [targets.NAME]      named targets (`--target NAME`), same fields as [target]
    [job]               the tmux session, its log, environment, GPU split, optional command
                        (`job_config.py`)
    [venv]              the job's python as a venv dflash builds at the place (`venv_config.py`)
    [train]             opaque to us: handed to the trainer as a TOML file

Precedence for a target's fields: command-line flags > the selected target's fields > per-place
defaults (at a remote place, `root` and `checkpoints` default to this project's own folders:
`settings/project.py`). Selection: `--target NAME` or `--host`, else the target last deployed
from this folder (`.dflash/state.json`), else `[target]`. Flags override only what they name:
`--host H --ct N` start from the table of deploy.toml for that place, else from a remote
`[target]` (with a note).
"""

from __future__ import annotations

import os
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from dflash_ops.connect import shell, ssh_names
from dflash_ops.connect.place import DEFAULT_TIMEOUT
from dflash_ops.errors import ConfigError
from dflash_ops.settings import project
from dflash_ops.settings.schema import (
    PLACE,
    DeployFile,
    JobConfig,
    LocalPlace,
    ProxmoxPlace,
    TargetTable,
    config_error,
    place_error,
)
from dflash_ops.settings.venv_config import VenvConfig, venv_config

CONFIG_ENV = "DFLASH_CONFIG"
DEFAULT_CONFIG_NAME = "deploy.toml"

REMOTE_PYTHON = "python3"
LOCAL_DIR = ".dflash/local"  # relative to the config's folder


@dataclass(frozen=True, kw_only=True)
class TargetFlags:
    """What the command line said about the target; `None` means "not given"."""

    target: str | None = None
    host: str | None = None
    user: str | None = None
    port: int | None = None
    ct: int | None = None

    @property
    def selects(self) -> bool:
        """True when the flags choose a target by themselves (no need for the remembered one)."""
        return self.target is not None or self.host is not None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def describe(self) -> str:
        """The place flags as typed: `--host H --ct N`."""
        return " ".join(f"--{k} {v}" for k, v in self.to_json().items() if k in ("host", "ct"))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> TargetFlags:
        known = {k: data[k] for k in ("target", "host", "user", "port", "ct") if k in data}
        return cls(**known)


@dataclass(frozen=True, kw_only=True)
class Venv:
    """The job's venv at a target: where it is, what it is made from and with."""

    folder: str  # <root>/venvs/<key>
    base: str  # the interpreter that creates it: the target's `python`
    config: VenvConfig

    @property
    def python(self) -> str:
        return f"{self.folder}/bin/python"


@dataclass(frozen=True, kw_only=True)
class Target:
    """A fully resolved place to run the job: every field has its final value."""

    name: str
    place: str  # "local" | "ssh" | "proxmox"
    host: str | None = None
    user: str | None = None
    port: int | None = None
    ct: int | None = None
    root: str
    checkpoints: str
    python: str  # the job's interpreter: the venv's with [venv]
    note: str = ""  # which table of deploy.toml gave the keys the flags did not name
    venv: Venv | None = None  # [venv]: the job's python is built at the place
    timeout: float = DEFAULT_TIMEOUT  # seconds one command (one step) may take at the place

    @property
    def remote(self) -> bool:
        return self.place != "local"

    def describe(self) -> str:
        """Human words for where the job runs: "local", "gpu@box:2222", "ct 200 on pve"."""
        if self.place == "local":
            return "local"
        host = f"{self.user}@{self.host}" if self.user else str(self.host)
        if self.port is not None:
            host += f":{self.port}"
        return f"ct {self.ct} on {host}" if self.place == "proxmox" else host


@dataclass(frozen=True, kw_only=True)
class Config:
    """One parsed `deploy.toml`. Targets stay raw tables until one is selected and resolved."""

    path: Path
    default_target: Mapping[str, Any]
    targets: Mapping[str, Mapping[str, Any]]
    job: JobConfig
    train: Mapping[str, Any]
    venv: VenvConfig | None = None

    @property
    def project_dir(self) -> Path:
        """The config's folder: `trainer/` is bundled from here, `.dflash/` lives here."""
        return self.path.parent


DEFAULT_TARGET = "default"  # the name of [target]; `--target default` selects it


def find_config(flag: str | Path | None, *, cwd: Path | None = None) -> Path:
    """`--config FILE`, else `$DFLASH_CONFIG`, else `./deploy.toml`; it must exist."""
    if flag is not None:
        path, source = Path(flag), "--config"
    elif os.environ.get(CONFIG_ENV):
        path, source = Path(os.environ[CONFIG_ENV]), f"${CONFIG_ENV}"
    else:
        path, source = (cwd or Path.cwd()) / DEFAULT_CONFIG_NAME, "the current folder"
    path = path.expanduser()
    if not path.is_absolute():
        path = (cwd or Path.cwd()) / path
    if not path.is_file():
        raise ConfigError(
            f"No config file at {path} (from {source}).",
            hint="Run dflash in the project folder (it has deploy.toml), pass --config FILE, "
            "or write one with: dflash init",
        )
    return path.resolve()


def load_config(path: Path) -> Config:
    """Read and check one `deploy.toml`. Errors name the key and the file."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(
            f"{path} is not valid TOML: {exc}.",
            hint="Fix the syntax at that line (key = value, text in quotes, [table] headers), "
            "or write a fresh file with: dflash init --force",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"Cannot read {path}: {exc}.") from None
    try:
        file = DeployFile.model_validate(raw)
    except ValidationError as exc:
        message, hint = config_error(exc, path)
        raise ConfigError(message, hint=hint or None) from None
    tables = raw.get("targets", {})
    return Config(
        path=path,
        default_target=_as_written(file.target, raw.get("target", {})),
        targets={name: _as_written(t, tables[name]) for name, t in file.targets.items()},
        job=file.job,
        train=file.train,
        venv=venv_config(file.venv, path=path),
    )


def _as_written(table: TargetTable, raw: Mapping[str, Any]) -> dict[str, Any]:
    """A checked target table as the keys the file wrote, in its order (notes name them so)."""
    values = table.model_dump(exclude_unset=True)
    return {key: values[key] for key in raw}


def resolve_target(config: Config, flags: TargetFlags, *, remembered: TargetFlags | None) -> Target:
    """Choose the target for this command and give every field its final value.

    Flags that select a target (`--target`, `--host`) win; otherwise the target remembered from
    the last deploy from this folder is used, with `--user`/`--port` still applied on top.
    `--host` without `--target` starts from a table of deploy.toml (`_table_for_place`), so
    the keys the flags do not name keep their values; `Target.note` says when that table is
    for another place.
    """
    if flags.ct is not None and flags.host is None:
        raise ConfigError(
            "--ct needs --host: the container lives on a Proxmox node that must be named.",
            hint="Name the node as well: --host <proxmox node> --ct <id> (or use --target NAME "
            "with a [targets.NAME] table that sets both).",
        )
    chosen = flags
    if not flags.selects and remembered is not None:
        chosen = TargetFlags(
            target=remembered.target,
            host=remembered.host,
            ct=remembered.ct,
            user=flags.user if flags.user is not None else remembered.user,
            port=flags.port if flags.port is not None else remembered.port,
        )
    table: Mapping[str, Any]
    note = ""
    if chosen.target == DEFAULT_TARGET and DEFAULT_TARGET not in config.targets:
        table, name = config.default_target, DEFAULT_TARGET  # --target default: [target]
    elif chosen.target is not None:
        if chosen.target not in config.targets:
            raise _no_such_target(config, chosen.target, remembered=chosen is not flags)
        table, name = config.targets[chosen.target], chosen.target
    elif chosen.host is not None:
        table, name, note = _table_for_place(config, chosen)
    else:
        table, name = config.default_target, DEFAULT_TARGET
    fields = dict(table)
    if chosen.host is not None and chosen.ct is None and chosen.target is None:
        fields.pop("ct", None)  # `--host H` alone is an SSH host, whatever the base table says
    if fields.get("place", "local") == "local" and "host" not in fields and chosen.host is None:
        for key in ("user", "port"):
            if getattr(flags, key) is not None and key not in table:
                raise ConfigError(
                    f"--{key} is for SSH targets, but target {name!r} runs on this machine.",
                    hint=f"Add --host HOST (or --target NAME of an ssh target), or drop --{key}.",
                )
    if chosen.host is not None:
        fields["host"] = chosen.host
        fields["place"] = "proxmox" if chosen.ct is not None else "ssh"
        if chosen.ct is not None:
            fields["ct"] = chosen.ct
    for key in ("user", "port"):
        value = getattr(chosen, key)
        if value is not None:
            fields[key] = value
    return replace(_finish_target(name, fields, config=config), note=note)


_PLACE_KEYS = ("place", "host", "ct")  # what `--host`/`--ct` name; the other keys are kept


def _table_for_place(config: Config, flags: TargetFlags) -> tuple[Mapping[str, Any], str, str]:
    """The table `--host H [--ct N]` starts from, its name, and a note for the user.

    Flags override only what they name: a table of deploy.toml for that very place (the same
    host and container) gives every other key (`python`, `root`, `checkpoints`, `user`,
    `port`). For another place the remote `[target]` does, and the note says so; a local
    `[target]` has nothing to give (its paths are this machine's).
    """
    tables = [(DEFAULT_TARGET, config.default_target), *config.targets.items()]
    for name, table in tables:
        if table.get("host") == flags.host and table.get("ct") == flags.ct:
            return table, name, ""
    name = str(flags.host) if flags.ct is None else f"{flags.host}/ct{flags.ct}"
    base = config.default_target
    if not base.get("host"):
        return {}, name, ""
    kept = [key for key in base if key not in _PLACE_KEYS]
    if not kept:
        return base, name, ""
    where = ", ".join(f"{key} {base[key]}" for key in _PLACE_KEYS[1:] if key in base)
    return (
        base,
        name,
        (
            f"{flags.describe()} is not the place of [target] ({where}) in "
            f"{config.path.name}; its {', '.join(kept)} apply there too."
        ),
    )


def _no_such_target(config: Config, name: str, *, remembered: bool) -> ConfigError:
    names = ", ".join([DEFAULT_TARGET, *sorted(config.targets)])
    if remembered:
        return ConfigError(
            f"No target named {name!r} (remembered from the last deploy in .dflash/state.json) "
            f"in {config.path}: it was removed.",
            hint=f"Choose one with --target ({names}; {DEFAULT_TARGET} is [target]) or "
            "--host HOST; the next deploy remembers it.",
        )
    known = ", ".join(sorted(config.targets)) or "none"
    return ConfigError(
        f"No target named {name!r} in {config.path}; known: {known}.",
        hint=f"Add a [targets.{name}] table, or choose another with --target NAME "
        f"({DEFAULT_TARGET} is [target]).",
    )


def _finish_target(name: str, fields: Mapping[str, Any], *, config: Config) -> Target:
    """Check the combination as one of the three places (`schema.PLACE`, the message names
    the key), then apply the per-place defaults."""
    where = f"target {name!r} (from {config.path} and the command line)"
    try:
        place = PLACE.validate_python({"place": "local", **fields})
    except ValidationError as exc:
        message, hint = place_error(exc, fields, where)
        raise ConfigError(message, hint=hint or None) from None
    host = user = None
    port = ct = None
    if isinstance(place, LocalPlace):
        base = config.project_dir / LOCAL_DIR
        root = _local_path(place.root, default=base, config=config)
        checkpoints = _local_path(
            place.checkpoints, default=Path(root) / "checkpoints", config=config
        )
        python = place.python or sys.executable
    else:
        host, user, port = place.host, place.user, place.port
        ct = place.ct if isinstance(place, ProxmoxPlace) else None
        ssh_names.split_user_host(host, where=f"{where}: host")  # OpenSSH's rule, before any
        if user is not None:  # ssh_config (Match exec) sees them
            ssh_names.check_user(user, where=f"{where}: user")
        root, checkpoints = _remote_folders(place.root, place.checkpoints, config=config)
        python = place.python or REMOTE_PYTHON
    venv = None
    if config.venv is not None:  # the target's python builds the venv; the job runs the venv's
        venv = Venv(folder=config.venv.folder(root, python), base=python, config=config.venv)
        python = venv.python
    return Target(
        name=name,
        place=place.place,
        host=host,
        user=user,
        port=port,
        ct=ct,
        root=root,
        checkpoints=checkpoints,
        python=python,
        venv=venv,
        timeout=place.timeout,
    )


def _remote_folders(
    root: str | None, checkpoints: str | None, *, config: Config
) -> tuple[str, str]:
    """`root` and `checkpoints` at a remote place (checked absolute by `schema`): the target's,
    else this project's own defaults (`project.load`: per project folder, so two projects never
    share a job)."""
    if root is None or checkpoints is None:
        defaults = project.load(config.project_dir)
        root = root if root is not None else defaults.remote_root
        checkpoints = checkpoints if checkpoints is not None else defaults.remote_checkpoints
    return shell.remote_path(root), shell.remote_path(checkpoints)


def _local_path(value: str | None, *, default: Path, config: Config) -> str:
    path = default if value is None else Path(value).expanduser()
    if not path.is_absolute():
        path = config.project_dir / path
    return shell.remote_path(os.path.normpath(path))
