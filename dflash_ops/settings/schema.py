"""`deploy.toml` as typed models: each key's type, bounds, default and meaning in one place.

`DeployFile.model_validate(raw, context={"path": path})` checks the whole file once, at the
boundary (`extra="forbid"`: a typo silently ignored is a run started with the wrong settings;
`strict`: `gpus = "8"` or `gpus = true` is refused, not coerced). A target's table is checked
for types only, since flags may still complete it (`--host`, `--ct`); the target a command uses
is checked as one of three places (`PLACE`, switched on `place`). `config_error` turns the first
failure into a `ConfigError` that names the key, the file and what to do. The README's key
tables are generated from the fields (`reference`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, TypeAdapter, ValidationError, ValidationInfo, field_validator

from dflash_ops.connect import shell
from dflash_ops.connect.place import DEFAULT_TIMEOUT
from dflash_ops.errors import UnsafeValue
from dflash_ops.settings.job_config import JobConfig
from dflash_ops.settings.table import Table, as_toml, fail, key, toml_type
from dflash_ops.settings.venv_config import VenvTable

PLACES = ("local", "ssh", "proxmox")


# ---- [target] and [targets.NAME] --------------------------------------------------------------


class TargetTable(Table):
    """One `[target]` or `[targets.NAME]` table as written: types only (flags may complete it)."""

    place: Literal["local", "ssh", "proxmox"] | None = key(
        None,
        '`"local"` (this machine), `"ssh"` (a host), `"proxmox"` (container `ct` on node `host`)',
        shown='`"local"`',
    )
    host: str | None = key(
        None,
        "ssh/proxmox: address, `user@host` or `~/.ssh/config` alias, resolved as `ssh` "
        'resolves it (see "SSH resolution")',
    )
    user: str | None = key(
        None,
        "SSH user",
        shown="from `~/.ssh/config`, else your local account name (as `ssh`)",
    )
    port: int | None = key(None, "SSH port", shown="from `~/.ssh/config`, else 22")
    ct: int | None = key(None, "proxmox: container id (an integer, 100–999999999)")
    root: str | None = key(
        None,
        "where `releases/` and `current` live (absolute at a remote place); the default is "
        "this project folder's own (below), and the job's tmux socket and deploy lock are "
        "keyed to it",
        shown="remote `/root/dflash/<project>`; local `.dflash/local`",
    )
    checkpoints: str | None = key(
        None,
        "the trainer's `--out` folder",
        shown="remote `/workspace/dflash/<project>`; local `<root>/checkpoints`",
    )
    python: str | None = key(
        None,
        "the job's interpreter at the place; with `[venv]`, the interpreter its venv is made from",
        shown="remote `python3`; local the interpreter running dflash",
    )
    timeout: float | None = key(
        None,
        "seconds one command at the place may take, and each step of "
        "deploy/restart/rollback/stop (the stop also gets the job's stop waits, the trainer's "
        "check of `[train]` at least 300 s); one that does not finish is ended there and the "
        "error names it. Raise it for a slow place",
        shown=f"`{as_toml(DEFAULT_TIMEOUT)}`",
    )


class _Place(Table):
    """What every place has once a target is resolved (flags and table merged)."""

    root: str | None = None
    checkpoints: str | None = None
    python: str | None = Field(None, min_length=1)
    timeout: float = Field(DEFAULT_TIMEOUT, gt=0, allow_inf_nan=False)


class LocalPlace(_Place):
    place: Literal["local"]


class _Remote(_Place):
    host: str
    user: str | None = None
    port: int | None = Field(None, ge=1, le=65535)

    @field_validator("host")
    @classmethod
    def _host(cls, host: str) -> str:
        if host.startswith("-") or not host.strip() or any(c.isspace() for c in host):
            raise fail(f"{{where}}: host = {host!r} is not a host name or address.")
        return host

    @field_validator("root", "checkpoints")
    @classmethod
    def _absolute(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is None:
            return None
        try:
            return shell.remote_path(value)
        except UnsafeValue as exc:
            name = info.field_name
            raise fail(f"{{where}}: {name}: {exc}", f"Set {name} to an absolute folder.") from None


class SSHPlace(_Remote):
    place: Literal["ssh"]


class ProxmoxPlace(_Remote):
    place: Literal["proxmox"]
    ct: int

    @field_validator("ct")
    @classmethod
    def _ct(cls, ct: int) -> int:
        try:
            return shell.container_id(ct)
        except UnsafeValue as exc:
            raise fail(f"{{where}}: ct: {exc}") from None


PLACE: TypeAdapter[LocalPlace | SSHPlace | ProxmoxPlace] = TypeAdapter(
    Annotated[LocalPlace | SSHPlace | ProxmoxPlace, Field(discriminator="place")]
)


def place_error(exc: ValidationError, fields: Mapping[str, Any], where: str) -> tuple[str, str]:
    """A resolved target's first failure as (message, hint), naming the key."""
    err = exc.errors()[0]
    kind, loc, ctx = err["type"], err["loc"], err.get("ctx") or {}
    place, name = str(fields.get("place", "local")), str(loc[-1]) if loc else "place"
    if kind == "dflash":
        return str(ctx["message"]).replace("{where}", where), str(ctx["hint"])
    if kind == "missing" and name == "host":
        return f"{where}: place is {place!r} but no host is set.", (
            'Set host = "..." in the target\'s table, or pass --host.'
        )
    if kind == "missing" and name == "ct":
        return f'{where}: place is "proxmox" but no container id (ct) is set.', (
            "Set ct = 200 in the target's table, or pass --ct."
        )
    if kind == "extra_forbidden" and place == "local":
        return f'{where}: {name!r} is set but place is "local".', (
            f'Remove {name!r}, or set place = "ssh" (or "proxmox").'
        )
    if kind == "extra_forbidden":
        return f'{where}: {name} = {fields.get(name)} is set but place is "{place}".', (
            'Set place = "proxmox" to run inside the container, or remove ct.'
        )
    if name == "port":
        return f"{where}: port = {fields.get('port')} is not a TCP port (1-65535).", ""
    if name == "timeout":
        return (
            f"{where}: timeout = {as_toml(fields.get('timeout'))} is not a number of seconds above 0.",
            (
                f"Set timeout = {DEFAULT_TIMEOUT:g} (how long one command may take there), or more "
                "for a slow place."
            ),
        )
    if name == "python":
        return f"{where}: python is empty.", 'Set python = "python3".'
    return f"{where}: {name}: {err['msg']}.", ""


# ---- the file ----------------------------------------------------------------------------------


class DeployFile(Table):
    """A whole `deploy.toml`; `[train]` is the trainer's, handed over unread."""

    target: TargetTable = TargetTable()
    targets: dict[str, TargetTable] = {}
    job: JobConfig = JobConfig()
    venv: VenvTable | None = None
    train: dict[str, Any] = {}


# The tables of the file, for the "known keys" of an unknown one.
_TABLES: dict[str, type[BaseModel]] = {
    "": DeployFile, "target": TargetTable, "targets": TargetTable, "job": JobConfig,
    "venv": VenvTable,
}  # fmt: skip

_WORDS = {
    "int_type": "an integer",
    "string_type": "a string",
    "float_type": "a number",
    "bool_type": "true or false",
    "dict_type": "a table",
    "model_type": "a table",
    "model_attributes_type": "a table",
    "list_type": "an array",
    "tuple_type": "an array",
    "mapping_type": "a table",
}


def config_error(exc: ValidationError, path: object) -> tuple[str, str]:
    """The file's first failure as (message, hint): the dotted key, the file, what it must be."""
    err = exc.errors()[0]
    kind, loc, value, ctx = err["type"], err["loc"], err.get("input"), err.get("ctx") or {}
    dotted = ".".join(str(part) for part in loc)
    if kind == "dflash":
        return str(ctx["message"]).replace("{path}", str(path)), str(ctx["hint"])
    if kind == "extra_forbidden":
        table = str(loc[0]) if len(loc) > 1 else ""
        model = _TABLES.get(table, DeployFile)
        known = ", ".join(model.model_fields)
        where = f" in [{'.'.join(str(p) for p in loc[:-1])}]" if table else ""
        return f"Unknown key {dotted!r} in {path}.", f"Known keys{where}: {known}."
    if kind == "literal_error":
        return (
            f"Key {dotted!r} in {path} must be one of {', '.join(PLACES)}, not {value!r}.",
            'Set place = "local", "ssh" or "proxmox".',
        )
    if kind in _WORDS:
        return (
            f"Key {dotted!r} in {path} must be {_WORDS[kind]}, not {value!r} ({toml_type(value)}).",
            "",
        )
    if kind in ("greater_than", "greater_than_equal", "less_than_equal", "finite_number"):
        bound = {
            "greater_than": f"more than {as_toml(ctx.get('gt'))}",
            "greater_than_equal": f"{as_toml(ctx.get('ge'))} or more",
            "less_than_equal": f"{as_toml(ctx.get('le'))} or less",
            "finite_number": "a finite number",
        }[kind]
        return f"Key {dotted!r} in {path} must be {bound}, not {as_toml(value)}.", ""
    if kind == "string_too_short":
        return f"Key {dotted!r} in {path} is empty.", "Remove it or set it."
    return f"Key {dotted!r} in {path}: {err['msg']}.", ""
