"""The checkpoints folder at a place: list it, and archive it before a fresh run.

Nothing is deleted by default. A fresh run (`deploy` without `--resume`, `restart --clean`) moves every
entry of the folder — checkpoints, metrics, the previous run's log — into
`<checkpoints>/archive/<UTC time>/` by rename (same filesystem: instant, whatever the size), so
the trainer starts from an empty folder and the old run can still be recovered.

Archiving is a step of the site program (`remote/site.sh`: `checkpoints_archive`), run inside
deploy's and restart's one command. Pruning (`remote.client.prune_runs`, what `doomed` chooses)
is the one deletion, of archived *runs* only (never the live entries). A run is a real folder
directly in `archive/` named by `archive_dest` (`YYYYMMDDTHHMMSS.mmmZ`); anything else there — a
symlink, a file, a folder with another name — is not a run: it is never counted among the N
kept, never followed and never deleted, only reported. Each deletion is one command at the place
(`site.sh prune-run`) that proves, there, that the entry is such a run: not a link, a folder, named as a
run, its parent resolving (`realpath -e`) to `<checkpoints>/archive` strictly inside the
checkpoints folder (so `/`, an empty path and `..` are refused before `rm` runs). `rm -rf` is
given the entry itself, never a resolved path: a link swapped in at the last moment is removed
as a link, and `rm -rf` never follows symlinks below the folder it removes.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dflash_ops.connect import shell
from dflash_ops.errors import CheckpointPathError, UnsafeValue

if TYPE_CHECKING:
    from dflash_ops.connect.place import Place

ARCHIVE = "archive"
Names = list[str]  # `list` is also a method of Checkpoints
# The name `archive_dest` gives a run: a UTC time to the millisecond. Nothing else is a run.
RUN_PATTERN = r"^[0-9]{8}T[0-9]{6}\.[0-9]{3}Z$"
_RUN = re.compile(RUN_PATTERN)
# What the trainer writes into the folder: `step-NNNNNNNN/` and, while writing,
# `.tmp-step-NNNNNNNN-PID/` (trainer/checkpoint.py), always real folders.
_CHECKPOINT = re.compile(r"^(step-[0-9]{8}|\.tmp-step-[0-9]{8}-[0-9]+)$")

# Names of the entries of folder $1, NUL-separated; nothing when the folder does not exist.
# With $2 = 1 a folder's size is what it holds (`du -sk`, in bytes), not its 4,096-byte entry.
_ENTRIES = (
    '[ -d "$1" ] || exit 0\n'
    'cd -- "$1" || exit 1\n'
    'if [ "${2:-0}" != 1 ]; then find . -mindepth 1 -maxdepth 1 -printf "%f\\t%y\\t%s\\t%T@\\0"; exit; fi\n'
    'find . -mindepth 1 -maxdepth 1 ! -type d -printf "%f\\t%y\\t%s\\t%T@\\0"\n'
    'while IFS= read -r -d "" rec; do\n'
    "  name=${rec%$'\\t'*}; k=$(du -sk -- \"./$name\" 2>/dev/null); k=${k%%[[:space:]]*}\n"
    '  printf "%s\\td\\t%s\\t%s\\0" "$name" "$(( ${k:-0} * 1024 ))" "${rec##*$\'\\t\'}"\n'
    'done < <(find . -mindepth 1 -maxdepth 1 -type d -printf "%f\\t%T@\\0")\n'
)


@dataclass(frozen=True, kw_only=True)
class Entry:
    name: str
    kind: str  # "f" file, "d" folder, "l" link, … (find's %y)
    size: int  # bytes (folders: what they hold, from `du`, when listed with sizes)
    mtime: float


@dataclass(frozen=True, kw_only=True)
class PruneReport:
    deleted: list[str]  # archive stamps removed
    kept: list[str]  # archive stamps left (the newest `keep`)
    refused: list[str]  # one message per entry that failed its path proof (left in place)
    skipped: list[str] = field(default_factory=list)  # one message per entry that is not a run


@dataclass(frozen=True, kw_only=True)
class Listing:
    live: list[Entry]
    archived: dict[str, list[Entry]]  # archive stamp → its entries
    # one message per live entry named like a checkpoint that the trainer did not make
    foreign: list[str] = field(default_factory=list)


class Checkpoints:
    """`path` at `place`: the folder the trainer writes to (`--out`)."""

    def __init__(self, place: Place, path: str) -> None:
        self.place = place
        try:
            self.path = shell.remote_path(path)
        except UnsafeValue as exc:
            raise CheckpointPathError(str(exc)) from None

    @property
    def archive_dir(self) -> str:
        return f"{self.path}/{ARCHIVE}"

    def entries(self, folder: str | None = None, *, sizes: bool = False) -> list[Entry]:
        """The entries of `folder` (default: the checkpoints folder); `sizes`: folders measured
        with `du` (reads every file below them)."""
        result = self.place.run(
            ["bash", "-c", _ENTRIES, "dflash-ls", folder or self.path, "1" if sizes else "0"]
        )
        records = result.stdout.decode("utf-8", "surrogateescape").split("\0")
        entries = [entry for record in records if (entry := _entry(record)) is not None]
        return sorted(entries, key=lambda e: e.name)

    def archive_dest(self, *, now: dt.datetime | None = None) -> str:
        """`archive/<UTC time>`: where `archive` moves the live entries."""
        now = now or dt.datetime.now(dt.UTC)
        return f"{self.archive_dir}/{now:%Y%m%dT%H%M%S}.{now.microsecond // 1000:03d}Z"

    def list(self) -> Listing:
        live = [e for e in self.entries(sizes=True) if e.name != ARCHIVE]
        archived = {
            stamp.name: self.entries(f"{self.archive_dir}/{stamp.name}", sizes=True)
            for stamp in self.entries(self.archive_dir)
            if is_run(stamp)
        }
        foreign = [_not_a_checkpoint(self.path, e) for e in live if not is_checkpoint_like(e)]
        return Listing(live=live, archived=archived, foreign=foreign)

    def doomed(self, *, keep: int) -> tuple[Names, Names, Names]:
        """What a prune keeping the newest `keep` runs would do: (runs to delete, runs kept,
        one message per entry of `archive/` that is not a run, `is_run`, left alone)."""
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
            raise CheckpointPathError(f"--keep must be 0 or more, not {keep!r}.", hint="")
        entries = self.entries(self.archive_dir)
        stamps = sorted(e.name for e in entries if is_run(e))
        skipped = [_not_a_run(self.archive_dir, e) for e in entries if not is_run(e)]
        doomed = stamps[: len(stamps) - keep] if keep else stamps
        return doomed, [s for s in stamps if s not in doomed], skipped

    def run_path(self, stamp: str) -> str:
        """The path of archived run `stamp`, proven to be directly inside `archive/`."""
        return self._inside(stamp, folder=self.archive_dir)

    def _inside(self, name: str, *, folder: str | None = None) -> str:
        """The path of entry `name`, proven to be directly inside the folder."""
        if not name or "/" in name or name in (".", "..") or "\0" in name:
            raise CheckpointPathError(f"Refusing {name!r}: not an entry of {folder or self.path}.")
        return f"{folder or self.path}/{name}"


def _entry(record: str) -> Entry | None:
    """One `NAME<TAB>KIND<TAB>SIZE<TAB>MTIME` record; None for one that is not (the end of a
    listing cut at its bound)."""
    fields = record.rsplit("\t", 3)
    if len(fields) != 4 or not fields[2].isdigit():
        return None
    name, kind, size, mtime = fields
    try:
        return Entry(name=name, kind=kind, size=int(size), mtime=float(mtime))
    except ValueError:
        return None


def is_run(entry: Entry) -> bool:
    """An archived run: a real folder (not a link) named as `archive_dest` names it."""
    return entry.kind == "d" and _RUN.fullmatch(entry.name) is not None


def is_checkpoint_like(entry: Entry) -> bool:
    """False for an entry named like the trainer's checkpoints that the trainer did not make (a
    link, a file, another `step-…` name): the trainer leaves it alone, and so does every
    command here."""
    if not entry.name.startswith(("step-", ".tmp-step-")):
        return True
    return entry.kind == "d" and _CHECKPOINT.fullmatch(entry.name) is not None


def _not_a_checkpoint(folder: str, entry: Entry) -> str:
    what = {"l": "a symbolic link", "d": "a folder not named step-NNNNNNNN"}.get(
        entry.kind, "not a folder"
    )
    return f"left alone {folder}/{entry.name}: {what}, not a checkpoint the trainer wrote"


def _not_a_run(folder: str, entry: Entry) -> str:
    what = {"l": "a symbolic link", "d": "a folder not named as a run"}.get(
        entry.kind, "not a folder"
    )
    return f"left alone {folder}/{entry.name}: {what}, not an archived run"
