"""Releases: build the code bundle, push it to `<root>/releases/<id>`, switch `current`.

A bundle is one tar: `trainer/` (without caches), `train.toml` (the resolved `[train]` table),
`launch.sh` (see `launch.py`), `command.sh` when `[job] command` is set, and `RELEASE.json`
(id, creation time, source revision, who deployed it from where).

It travels as ONE stream into `tar -x` at the place — through `pct exec` stdin for a container,
so no path on the Proxmox host is assumed — into `releases/<id>.tmp`. Only a complete unpack is
renamed to `releases/<id>`, and only then does `current` move: a new symlink under a temporary
name renamed over the old one (`ln -sfn` + `mv -T`, an atomic rename). An interrupted deploy
therefore leaves the previous `current` untouched; the next deploy removes its `.tmp`. Those
steps are the site program's (`remote/site.sh`: `release_unpack`, `release_switch`,
`release_prune`); this module builds the bundle, reads the releases, and words their errors.
"""

from __future__ import annotations

import builtins
import datetime as dt
import getpass
import io
import json
import logging
import re
import secrets
import socket
import subprocess
import tarfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_ops.connect import shell
from dflash_ops.errors import ReleaseError
from dflash_ops.remote.launch import COMMAND_FILE, TRAIN_CONFIG, LaunchPlan, render
from dflash_ops.settings import toml_writer
from dflash_ops.untrusted import last_line

if TYPE_CHECKING:
    from dflash_ops.connect.place import Place

log = logging.getLogger(__name__)

KEEP = 5
RELEASE_ID = re.compile(r"\d{8}-\d{6}-\d{3}-[0-9a-f]{4}")
_SKIP = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}

COMPLETE = ".complete"  # written last into a release: everything before it is on disk

# For every complete release: id, size in bytes, RELEASE.json squeezed onto one line; NUL-ended.
_DESCRIBE = (
    '[ -d "$1/releases" ] || exit 0\n'
    'cd -- "$1/releases" || exit 0\n'
    "for d in *; do\n"
    f'  [ -f "$d/{COMPLETE}" ] || continue\n'
    '  size=$(du -sb -- "$d" | cut -f1)\n'
    '  meta=$(tr -d "\\n" < "$d/RELEASE.json" 2>/dev/null || true)\n'
    '  printf "%s\\t%s\\t%s\\0" "$d" "$size" "$meta"\n'
    "done\n"
)


def new_release_id(now: dt.datetime | None = None) -> str:
    """`YYYYmmdd-HHMMSS-mmm-xxxx` (UTC): sorts by time, unique across machines."""
    now = now or dt.datetime.now(dt.UTC)
    return f"{now:%Y%m%d-%H%M%S}-{now.microsecond // 1000:03d}-{secrets.token_hex(2)}"


@dataclass(frozen=True, kw_only=True)
class Bundle:
    release_id: str
    data: bytes
    meta: Mapping[str, Any]


def source_revision(folder: Path) -> dict[str, Any] | None:
    """The git commit of `folder` (and whether the tree has changes), or None outside git."""
    try:
        rev = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(folder), "status", "--porcelain", "--", "trainer"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return {"revision": rev.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def build_bundle(
    project_dir: Path,
    *,
    plan: LaunchPlan,
    train: Mapping[str, Any],
    target: str,
) -> Bundle:
    """Tar `trainer/` and the generated files in memory (the trainer is a few hundred KB)."""
    trainer = project_dir / "trainer"
    if plan.command is None and not (trainer / "__main__.py").is_file():
        raise ReleaseError(
            f"No trainer to deploy: {trainer / '__main__.py'} does not exist.",
            hint="Run dflash from the project folder, or set [job] command in deploy.toml.",
        )
    meta = {
        "id": plan.release_id,
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "source": source_revision(project_dir),
        "by": f"{getpass.getuser()}@{socket.gethostname()}",
        "target": target,
        "gpus": plan.gpus,
        "command": plan.command is not None,
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if trainer.is_dir():
            tar.add(trainer, arcname="trainer", filter=_clean, recursive=True)
        _add(tar, TRAIN_CONFIG, toml_writer.dumps(train).encode())
        _add(tar, "launch.sh", render(plan).encode(), mode=0o755)
        if plan.command is not None:
            _add(tar, COMMAND_FILE, plan.command.encode() + b"\n")
        _add(tar, "RELEASE.json", (json.dumps(meta, indent=2) + "\n").encode())
    return Bundle(release_id=plan.release_id, data=buffer.getvalue(), meta=meta)


def _clean(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Drop caches and bytecode; own everything as root:root (the place's user takes it)."""
    parts = info.name.split("/")
    if any(part in _SKIP for part in parts) or info.name.endswith((".pyc", ".pyo")):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def _add(tar: tarfile.TarFile, name: str, data: bytes, *, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode = len(data), mode
    info.mtime = int(dt.datetime.now(dt.UTC).timestamp())
    tar.addfile(info, io.BytesIO(data))


class Releases:
    """The releases under `root` at `place`: `releases/<id>/` and the `current` symlink."""

    def __init__(self, place: Place, root: str) -> None:
        self.place = place
        self.root = shell.remote_path(root)

    @property
    def current_path(self) -> str:
        return f"{self.root}/current"

    def unpack_failed(self, release_id: str, stderr: str) -> ReleaseError:
        return ReleaseError(
            f"Could not unpack release {release_id} into {self.root}/releases on "
            f"{self.place.description}: {last_line(stderr)}",
            hint="Check free space and permissions there; the current release is unchanged.",
        )

    def switch_failed(self, release_id: str, stderr: str) -> ReleaseError:
        return ReleaseError(
            f"Could not switch {self.current_path} to release {release_id} on "
            f"{self.place.description}: {last_line(stderr)}",
            hint=f"{self.current_path} must be a symlink (or absent); check it by hand.",
        )

    def current(self) -> str | None:
        """The id `current` points at, or None before the first deploy."""
        result = self.place.run(["readlink", "--", self.current_path], check=False)
        if result.exit_code != 0:
            return None
        name = result.stdout.decode("utf-8", "replace").strip().rsplit("/", 1)[-1]
        return name if RELEASE_ID.fullmatch(name) else None

    def list(self) -> list[str]:
        """The complete releases (with their marker), oldest first."""
        return [info.release_id for info in self.describe()]

    def describe(self) -> builtins.list[ReleaseInfo]:  # `list` here is the method above
        """Every complete release with its size and RELEASE.json, oldest first."""
        result = self.place.run(["bash", "-c", _DESCRIBE, "dflash-releases", self.root])
        current = self.current()
        infos = []
        for record in result.stdout.decode("utf-8", "replace").split("\0"):
            if not record:
                continue
            name, _, rest = record.partition("\t")
            size, _, meta_text = rest.partition("\t")
            if not RELEASE_ID.fullmatch(name):
                continue
            try:
                meta = json.loads(meta_text) if meta_text else {}
            except ValueError:
                meta = {}
            infos.append(
                ReleaseInfo(
                    release_id=name,
                    size=int(size) if size.isdigit() else 0,
                    meta=meta if isinstance(meta, dict) else {},
                    current=name == current,
                )
            )
        return sorted(infos, key=lambda info: info.release_id)

    def rollback_target(self, to: str | None = None) -> str:
        """The release `rollback` switches to: `to` (which must be complete), else the newest
        complete release older than `current`."""
        releases = self.list()
        if to is not None:
            if to not in releases:
                raise ReleaseError(
                    f"Release {to!r} is not a complete release at {self.root} on "
                    f"{self.place.description}.",
                    hint="List them with: dflash releases",
                )
            return to
        current = self.require_current()
        target = previous(releases, current)
        if target is None:
            raise ReleaseError(
                f"No complete release older than the current one ({current}) at {self.root}.",
                hint="List them with: dflash releases (dflash rollback --to ID picks one)",
            )
        return target

    def require_current(self) -> str:
        release = self.current()
        if release is None:
            raise self.nothing_deployed()
        return release

    def require_trainer(self, command: str) -> str:
        """The current release, which must hold a trainer with its one entry (`python -m
        trainer VERB`): a release of a `[job] command` has none, and one deployed by a dflash
        before that entry has `trainer/` without `__main__.py` (reached by a rollback)."""
        release = self.require_current()
        trainer = f"{self.root}/releases/{release}/trainer"
        probe = 'if [ -f "$1/__main__.py" ]; then echo entry; elif [ -d "$1" ]; then echo old; fi'
        found = self.place.run(["sh", "-c", probe, "dflash-trainer", trainer], check=False)
        answer = found.stdout.decode("utf-8", "replace").strip()
        if answer == "entry":
            return release
        where = f"Release {release} at {self.root} on {self.place.description}"
        if answer == "old":
            raise ReleaseError(
                f"{where} was deployed by an earlier dflash: its trainer has no `python -m "
                f"trainer` entry, which {command} runs.",
                hint="Deploy again (dflash deploy; the checkpoints are archived, and --resume "
                "goes on from the last one), or run the dflash that deployed it.",
            )
        raise ReleaseError(
            f"{where} has no trainer (its job is a [job] command), so {command} has nothing to "
            "run.",
            hint="Deploy a release with trainer/ (a config without [job] command).",
        )

    def nothing_deployed(self) -> ReleaseError:
        return ReleaseError(
            f"Nothing is deployed at {self.root} on {self.place.description}.",
            hint="Deploy first: dflash deploy",
        )


@dataclass(frozen=True, kw_only=True)
class ReleaseInfo:
    release_id: str
    size: int  # bytes on disk
    meta: Mapping[str, Any]  # RELEASE.json: created, source, by, target, …
    current: bool


def previous(releases: list[str], current: str | None) -> str | None:
    """The newest release older than `current` (ids sort by time), or None."""
    older = [r for r in sorted(releases) if current is not None and r < current]
    return older[-1] if older else None


def checked_id(release_id: str) -> str:
    if not RELEASE_ID.fullmatch(release_id):
        raise ReleaseError(f"{release_id!r} is not a release id.")
    return release_id
