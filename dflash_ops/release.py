"""Releases: build the code bundle, push it to `<root>/releases/<id>`, switch `current`.

A bundle is one tar: `trainer/` (without caches), `train.toml` (the resolved `[train]` table),
`launch.sh` (see `launch.py`), `command.sh` when `[job] command` is set, and `RELEASE.json`
(id, creation time, source revision, who deployed it from where).

It travels as ONE stream into `tar -x` at the place — through `pct exec` stdin for a container,
so no path on the Proxmox host is assumed — into `releases/<id>.tmp`. Only a complete unpack is
renamed to `releases/<id>`, and only then does `current` move: a new symlink under a temporary
name renamed over the old one (`ln -sfn` + `mv -T`, an atomic rename). An interrupted deploy
therefore leaves the previous `current` untouched; the next deploy removes its `.tmp`.
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

from dflash_ops import shell, toml_writer
from dflash_ops.errors import ReleaseError
from dflash_ops.launch import COMMAND_FILE, TRAIN_CONFIG, LaunchPlan, render

if TYPE_CHECKING:
    from dflash_ops.place import Place

log = logging.getLogger(__name__)

KEEP = 5
RELEASE_ID = re.compile(r"\d{8}-\d{6}-\d{3}-[0-9a-f]{4}")
_SKIP = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache"}

COMPLETE = ".complete"  # written last into a release: everything before it is on disk

# A release id as a shell pattern (RELEASE_ID's glob twin; LC_ALL=C makes the ranges ASCII).
RELEASE_GLOB = "[0-9]" * 8 + "-" + "[0-9]" * 6 + "-" + "[0-9]" * 3 + "-" + "[0-9a-f]" * 4

# The steps of a release as bash functions, values as positional arguments. `Releases` runs them
# as commands; `dflash deploy` runs the same text inside its one command (`deploy_script`).
FUNCTIONS = r"""
dflash_unpack() {  # $1 root, $2 id; stdin: the bundle's tar
  # Unfinished releases of earlier, interrupted deploys (`*.tmp`) are removed first; the
  # marker is written only after tar succeeded and the files were flushed.
  local rel=$1/releases d
  mkdir -p -- "$rel" || return 1
  for d in "$rel"/*.tmp; do if [ -e "$d" ]; then rm -rf -- "$d" || return 1; fi; done
  mkdir -- "$rel/$2.tmp" || return 1
  tar -x --no-same-owner -C "$rel/$2.tmp" -f - || return 1
  sync -f -- "$rel/$2.tmp" || return 1
  : > "$rel/$2.tmp/@COMPLETE@"
}
dflash_switch() {  # $1 root, $2 id: complete release $2, point `current` at it; list releases
  # `.tmp` is renamed away once it has its marker; `current` moves atomically (a new link
  # renamed over the old one).
  ( cd -- "$1" || exit 1
    if [ -f "releases/$2.tmp/@COMPLETE@" ]; then
      mv -T -- "releases/$2.tmp" "releases/$2" || exit 1
    fi
    [ -f "releases/$2/@COMPLETE@" ] || { echo "release $2 is not complete" >&2; exit 1; }
    ln -sfn -- "releases/$2" .current.tmp || exit 1
    mv -T -- .current.tmp current || exit 1
    ls -1 -- releases )
}
dflash_prune() {  # $1 root, $2 keep, $3 current, then release ids; prints each id it deleted
  # All but the newest $2 go, never $3 and never the newest release older than $3 (the one
  # `rollback` goes back to). Ids sort by time.
  local LC_ALL=C root=$1 keep=$2 current=$3 id prev="" i
  local -a ids=()
  shift 3
  while IFS= read -r id; do
    case $id in @GLOB@) ids+=("$id") ;; esac
  done < <(printf '%s\n' "$@" | sort -u)
  [ "$keep" -gt 0 ] || return 0
  for id in "${ids[@]}"; do [[ $id < $current ]] && prev=$id; done
  for ((i = 0; i < ${#ids[@]} - keep; i++)); do
    id=${ids[i]}
    if [ "$id" = "$current" ] || [ "$id" = "$prev" ]; then continue; fi
    rm -rf -- "$root/releases/$id" || return 1
    printf '%s\n' "$id"
  done
}
""".replace("@COMPLETE@", COMPLETE).replace("@GLOB@", RELEASE_GLOB)
_UNPACK = FUNCTIONS + 'dflash_unpack "$@"\n'
_SWITCH = FUNCTIONS + 'dflash_switch "$@"\n'
_PRUNE = FUNCTIONS + 'dflash_prune "$@"\n'
# Both in one command (`Releases.push_and_switch`); the marker line says the unpack succeeded.
_UNPACKED = b"unpacked"
_PUSH_AND_SWITCH = FUNCTIONS + (
    f'dflash_unpack "$@" || exit 1\necho {_UNPACKED.decode()}\ndflash_switch "$@"\n'
)

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
    if plan.command is None and not (trainer / "train.py").is_file():
        raise ReleaseError(
            f"No trainer to deploy: {trainer / 'train.py'} does not exist.",
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

    def push(self, bundle: Bundle) -> None:
        """Unpack the bundle, streamed as one tar, into `releases/<id>.tmp`."""
        result = self.place.run(
            ["bash", "-c", _UNPACK, "dflash-unpack", self.root, checked_id(bundle.release_id)],
            stdin=bundle.data,
            check=False,
        )
        if result.exit_code != 0:
            raise self.unpack_failed(bundle.release_id, result.stderr_text)

    def switch(self, release_id: str) -> list[str]:
        """Complete `release_id` and point `current` at it; returns every release, oldest first."""
        result = self.place.run(
            ["bash", "-c", _SWITCH, "dflash-switch", self.root, checked_id(release_id)], check=False
        )
        if result.exit_code != 0:
            raise self.switch_failed(release_id, result.stderr_text)
        return _release_names(result.stdout)

    def push_and_switch(self, bundle: Bundle) -> list[str]:
        """`push` then `switch` in ONE command at the place: over SSH every command starts the
        user's shell, which costs more than the work itself. The same scripts, values as
        arguments; an `unpacked` line between them tells which step failed."""
        result = self.place.run(
            [
                "bash",
                "-c",
                _PUSH_AND_SWITCH,
                "dflash-release",
                self.root,
                checked_id(bundle.release_id),
            ],
            stdin=bundle.data,
            check=False,
        )
        marker, _, names = result.stdout.partition(b"\n")
        if result.exit_code != 0:
            if marker == _UNPACKED:
                raise self.switch_failed(bundle.release_id, result.stderr_text)
            raise self.unpack_failed(bundle.release_id, result.stderr_text)
        return _release_names(names)

    def unpack_failed(self, release_id: str, stderr: str) -> ReleaseError:
        return ReleaseError(
            f"Could not unpack release {release_id} into {self.root}/releases on "
            f"{self.place.description}: {_last_line(stderr)}",
            hint="Check free space and permissions there; the current release is unchanged.",
        )

    def switch_failed(self, release_id: str, stderr: str) -> ReleaseError:
        return ReleaseError(
            f"Could not switch {self.current_path} to release {release_id} on "
            f"{self.place.description}: {_last_line(stderr)}",
            hint=f"{self.current_path} must be a symlink (or absent); check it by hand.",
        )

    def prune(
        self, releases: list[str], *, keep: int = KEEP, current: str | None = None
    ) -> list[str]:
        """Delete all but the newest `keep` of `releases` — never `current`, never the release
        `rollback` would go back to (the newest one before `current`): `dflash_prune`."""
        current = current or self.current()
        names = [checked_id(r) for r in releases]
        result = self.place.run(
            ["bash", "-c", _PRUNE, "dflash-prune", self.root, str(keep), current or "", *names]
        )
        return _release_names(result.stdout)

    def deploy(self, bundle: Bundle, *, keep: int = KEEP) -> list[str]:
        """push → switch (one command) → prune; returns the releases that were removed."""
        releases = self.push_and_switch(bundle)
        return self.prune(releases, keep=keep, current=bundle.release_id)

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
            name, size, meta_text = record.split("\t", 2)
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


def _release_names(stdout: bytes) -> list[str]:
    names = stdout.decode("utf-8", "replace").splitlines()
    return sorted(n for n in names if RELEASE_ID.fullmatch(n))


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[-1] if lines else "no error output"


def checked_id(release_id: str) -> str:
    if not RELEASE_ID.fullmatch(release_id):
        raise ReleaseError(f"{release_id!r} is not a release id.")
    return release_id
