"""This project folder's own place at remote targets, kept in `.dflash/project.json`.

Two project folders deploying to one host or container must not share a root: the root keys
the tmux socket (`remote.job.socket_for`), the releases, `current` and the deploy lock, so a
shared one lets a folder that never deployed stop, replace or show the other's job. The local
default is per folder already (`.dflash/local` beside deploy.toml); the remote defaults are made
per folder the same way: `/root/dflash/<project>` and `/workspace/dflash/<project>`, where
`<project>` is the folder's name and 8 random hex digits, drawn once and kept in
`.dflash/project.json` (beside `state.json`), so a fresh clone is another project and a moved
folder is still the same one.

A folder that deployed with an earlier dflash (it has `.dflash/state.json` but no
`project.json`) keeps the old shared defaults, `/root/dflash` and `/workspace/checkpoints`: its
running job and checkpoints are found where they are. `LEGACY_ROOT` names them for the notice
that says how to give such a folder a root of its own.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_ops.errors import ConfigError

STATE_DIR = ".dflash"
PROJECT_FILE = "project.json"
LEGACY_STATE = "state.json"  # written by every deploy, also by dflash before project.json
LEGACY_ROOT = "/root/dflash"
LEGACY_CHECKPOINTS = "/workspace/checkpoints"
ROOTS = "/root/dflash"  # the new defaults: <ROOTS>/<project>, <CHECKPOINTS>/<project>
CHECKPOINTS = "/workspace/dflash"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclass(frozen=True, kw_only=True)
class Project:
    """A project folder's name and its default folders at every remote place."""

    id: str
    remote_root: str
    remote_checkpoints: str

    @property
    def legacy(self) -> bool:
        """Whether the defaults are the shared ones of an earlier dflash."""
        return self.remote_root == LEGACY_ROOT


def project_path(project_dir: Path) -> Path:
    return project_dir / STATE_DIR / PROJECT_FILE


def load(project_dir: Path) -> Project:
    """The project of `project_dir`: read from `.dflash/project.json`, or made and written there
    on first use (the old shared defaults for a folder that deployed before the file existed)."""
    path = project_path(project_dir)
    try:
        return _parse(json.loads(path.read_text(encoding="utf-8")))
    except FileNotFoundError:
        pass
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"{path} is unreadable ({exc}).",
            hint="Restore it (it names this project's folders at remote places), or set root "
            "and checkpoints in the target's table of deploy.toml.",
        ) from None
    return _create(path, _new(project_dir))


def _new(project_dir: Path) -> Project:
    name = _UNSAFE.sub("-", project_dir.resolve().name).strip(".-")[:40] or "project"
    ident = f"{name}-{secrets.token_hex(4)}"
    if (project_dir / STATE_DIR / LEGACY_STATE).is_file():  # deployed by an earlier dflash
        return Project(id=ident, remote_root=LEGACY_ROOT, remote_checkpoints=LEGACY_CHECKPOINTS)
    return Project(
        id=ident, remote_root=f"{ROOTS}/{ident}", remote_checkpoints=f"{CHECKPOINTS}/{ident}"
    )


def _parse(data: Any) -> Project:
    project = Project(
        id=str(data["id"]),
        remote_root=str(data["remote_root"]),
        remote_checkpoints=str(data["remote_checkpoints"]),
    )
    if not project.remote_root.startswith("/") or not project.remote_checkpoints.startswith("/"):
        raise ValueError("remote_root and remote_checkpoints must be absolute")
    return project


def _create(path: Path, project: Project) -> Project:
    """Write `project` to `path` unless another command wrote one first (then that one is the
    project): the file is made whole beside it and linked into place, which fails if it exists."""
    data = {
        "id": project.id,
        "remote_root": project.remote_root,
        "remote_checkpoints": project.remote_checkpoints,
    }
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".project.", suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=2)
            handle.write("\n")
        os.link(tmp, path)
    except FileExistsError:
        return load(path.parent.parent)
    except OSError as exc:
        raise ConfigError(
            f"Cannot write {path} ({exc.strerror or exc}): it names this project's folders at "
            "remote places.",
            hint="Make the project folder writable, or set root and checkpoints in the "
            "target's table of deploy.toml.",
        ) from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return project
