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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import field_validator, model_validator

from dflash_ops.connect import shell
from dflash_ops.errors import ConfigError, UnsafeValue
from dflash_ops.settings.table import Table, fail, key

REQUIREMENTS = "trainer/requirements.txt"  # relative to the config's folder


class VenvTable(Table):
    """The `[venv]` table as written; `venv_config.VenvConfig` adds the requirements' text."""

    torch_index: str | None = key(
        None,
        "pip index of the torch build (`https://download.pytorch.org/whl/cuXXX` for CUDA "
        "XX.X); torch is installed from it first, the rest from PyPI",
    )
    wheels: str | None = key(
        None,
        "a folder of wheels at the place (absolute): pip installs from it only (`--no-index "
        "--find-links`), for a node without network; put a CUDA torch wheel and every "
        "requirement's wheel in it (`pip download -r trainer/requirements.txt -d DIR` on a "
        "machine with the same Python and platform). Not with `torch_index`",
    )
    packages: tuple[str, ...] = key(
        (), "more requirements (pip's syntax) beside `trainer/requirements.txt`", shown="`[]`"
    )
    system_site_packages: bool = key(
        False,
        "`python -m venv --system-site-packages`: the base python's packages (a preinstalled "
        "torch, say) are seen too",
    )

    @field_validator("packages", mode="before")
    @classmethod
    def _array(cls, value: Any) -> Any:
        return tuple(value) if isinstance(value, list) else value  # TOML arrays are lists

    @field_validator("torch_index")
    @classmethod
    def _index(cls, index: str | None) -> str | None:
        if index is not None and not index.startswith(("https://", "http://")):
            raise fail(
                f"Key 'venv.torch_index' in {{path}} must be an http(s) URL, not {index!r}.",
                'For CUDA 12.8: torch_index = "https://download.pytorch.org/whl/cu128".',
            )
        return index

    @field_validator("wheels")
    @classmethod
    def _wheels(cls, wheels: str | None) -> str | None:
        if wheels is None:
            return None
        try:
            return shell.remote_path(wheels)
        except UnsafeValue as exc:
            raise fail(f"Key 'venv.wheels' in {{path}}: {exc}") from None

    @field_validator("packages")
    @classmethod
    def _requirements(cls, packages: tuple[str, ...]) -> tuple[str, ...]:
        if any(not line.strip() or line.lstrip().startswith("-") for line in packages):
            raise fail(
                f"Key 'venv.packages' in {{path}} must be an array of requirements, not "
                f"{list(packages)!r} (array)."
            )
        return packages

    @model_validator(mode="after")
    def _one_source(self) -> VenvTable:
        if self.torch_index is not None and self.wheels is not None:
            raise fail(
                "Keys 'venv.torch_index' and 'venv.wheels' in {path}: wheels installs every "
                "package from that folder only, so no index is asked.",
                "Keep wheels for an offline node (with a CUDA torch wheel in it), or torch_index.",
            )
        return self


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


def venv_config(table: VenvTable | None, *, path: Path) -> VenvConfig | None:
    """The `[venv]` table of `path` (None without one; its values were checked with the file,
    `schema.VenvTable`), with the trainer's requirements read from beside it."""
    if table is None:
        return None
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
        requirements="\n".join([*lines, *(p.strip() for p in table.packages)]) + "\n",
        torch_index=table.torch_index,
        wheels=table.wheels,
        packages=table.packages,
        system_site_packages=table.system_site_packages,
    )
