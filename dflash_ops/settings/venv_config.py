"""`[venv]` of deploy.toml: the job's python as a virtual environment that dflash builds at the
place from the trainer's own requirements (`dflash setup`, or a deploy that finds it missing).

    [venv]
    torch_index = "https://download.pytorch.org/whl/cu128"   # torch from there (a CUDA build)
    wheels = "/srv/wheels"              # or: an offline node, every package from this folder
    packages = ["tensorboard>=2.14"]    # beside trainer/requirements.txt
    system_site_packages = false        # the base interpreter's packages seen too

The venv is `<root>/venvs/<key>`, the key a hash of what it is built from (the requirements'
text, these settings, the base interpreter: the target's `python`), so it is built once and
every release uses it until one of them changes; the job runs `<venv>/bin/python`. A venv, not
`pip install` into the place's python: Debian and Ubuntu refuse that (PEP 668).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_ops.connect import shell
from dflash_ops.errors import ConfigError, UnsafeValue
from dflash_ops.settings.toml_keys import BOOL, LIST, STR, Schema, check_keys, type_error

REQUIREMENTS = "trainer/requirements.txt"  # relative to the config's folder
_KEYS: Schema = {
    "torch_index": STR,
    "wheels": STR,
    "packages": LIST,
    "system_site_packages": BOOL,
}


@dataclass(frozen=True, kw_only=True)
class VenvConfig:
    """The `[venv]` table, and the requirements' text it installs (the trainer's file, then
    `packages`)."""

    requirements: str
    torch_index: str | None = None
    wheels: str | None = None
    packages: tuple[str, ...] = ()
    system_site_packages: bool = False

    def folder(self, root: str, base: str) -> str:
        """`<root>/venvs/<key>`: the key changes with anything the venv is built from."""
        what = [self.requirements, self.torch_index, self.wheels, self.system_site_packages, base]
        key = hashlib.sha256(json.dumps(what).encode("utf-8")).hexdigest()[:12]
        return f"{root.rstrip('/')}/venvs/{key}"

    @property
    def torch(self) -> str | None:
        """The requirement line of torch (installed from `torch_index` first), if any."""
        for line in self.requirements.splitlines():
            name = line.split("#", 1)[0].strip()
            if name.lower().startswith("torch") and not name[5:6].isalnum() and name[5:6] != "-":
                return name
        return None


def venv_config(table: Mapping[str, Any] | None, *, path: Path) -> VenvConfig | None:
    """The `[venv]` table of `path` (None without one), each value checked, the trainer's
    requirements read from beside it."""
    if table is None:
        return None
    check_keys(table, _KEYS, prefix="venv", path=path)
    index, wheels = table.get("torch_index"), table.get("wheels")
    if index is not None and not index.startswith(("https://", "http://")):
        raise ConfigError(
            f"Key 'venv.torch_index' in {path} must be an http(s) URL, not {index!r}.",
            hint='For CUDA 12.8: torch_index = "https://download.pytorch.org/whl/cu128".',
        )
    if index is not None and wheels is not None:
        raise ConfigError(
            f"Keys 'venv.torch_index' and 'venv.wheels' in {path}: wheels installs every "
            "package from that folder only, so no index is asked.",
            hint="Keep wheels for an offline node (with a CUDA torch wheel in it), or torch_index.",
        )
    if wheels is not None:
        try:
            wheels = shell.remote_path(wheels)
        except UnsafeValue as exc:
            raise ConfigError(f"Key 'venv.wheels' in {path}: {exc}") from None
    packages = table.get("packages", [])
    for item in packages:
        if not isinstance(item, str) or not item.strip() or item.lstrip().startswith("-"):
            raise type_error("venv.packages", packages, "an array of requirements", path)
    file = path.parent / REQUIREMENTS
    try:
        text = file.read_text(encoding="utf-8")
    except OSError:
        raise ConfigError(
            f"[venv] in {path} builds the job's venv from {file}, which cannot be read.",
            hint="Run dflash in the project folder (trainer/ beside deploy.toml), or remove [venv].",
        ) from None
    lines = [line.strip() for line in text.splitlines() if line.split("#", 1)[0].strip()]
    return VenvConfig(
        requirements="\n".join([*lines, *(p.strip() for p in packages)]) + "\n",
        torch_index=index,
        wheels=wheels,
        packages=tuple(packages),
        system_site_packages=bool(table.get("system_site_packages", False)),
    )
