"""The checkpoints folder at a place: list it, and archive it before a fresh run.

Nothing is deleted by default. A fresh run (`deploy` without `--resume`, `restart --clean`) moves every
entry of the folder — checkpoints, metrics, the previous run's log — into
`<checkpoints>/archive/<UTC time>/` by rename (same filesystem: instant, whatever the size), so
the trainer starts from an empty folder and the old run can still be recovered.

Archiving is a step of the site program (`remote/site.sh`: `checkpoints_archive`), run inside
deploy's and restart's one command. Pruning (`remote.client.delete_runs`, what `choose` picks)
is the one deletion, of archived *runs* only (never the live entries). A run is a real folder
directly in `archive/` named by `archive_dest` (`YYYYMMDDTHHMMSS.mmmZ`); anything else there — a
symlink, a file, a folder with another name — is not a run: it is never counted among the N
kept, never followed and never deleted, only reported. Each deletion is one command at the place
(`site.sh prune-run`) that proves, there, that the entry is such a run: not a link, a folder, named as a
run, its parent resolving (`realpath -e`) to `<checkpoints>/archive` strictly inside the
checkpoints folder (so `/`, an empty path and `..` are refused before `rm` runs). `rm -rf` is
given the entry itself, never a resolved path: a link swapped in at the last moment is removed
as a link, and `rm -rf` never follows symlinks below the folder it removes.

Which runs a prune keeps (`choose`) is decided by what they hold, not by their age alone: only a
run with a verified checkpoint counts among the N kept, and the newest such run is never deleted
while the live folder has none (a fresh deploy has just archived the run that trained). Whether
a folder holds one is the trainer's own answer (`VERIFY`: `trainer.model.checkpoint.find_resumable`,
the function a resume uses), run at the place by the job's python.
"""

from __future__ import annotations

import datetime as dt
import json
import re
from collections.abc import Sequence
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
# `.tmp-step-NNNNNNNN-PID/` (trainer/model/checkpoint.py), always real folders.
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


Entries = list[Entry]


@dataclass(frozen=True, kw_only=True)
class PruneReport:
    deleted: list[str]  # archive stamps removed
    refused: list[str]  # one message per entry that failed its path proof (left in place)


@dataclass(frozen=True, kw_only=True)
class Run:
    """One archived run: its stamp, the bytes it holds, its newest verified checkpoint."""

    stamp: str
    size: int
    checkpoint: str | None  # `step-…` (None: no verified checkpoint in it)


@dataclass(frozen=True, kw_only=True)
class Verdict:
    """What a prune does with one run, and why (said in the listing before anything goes)."""

    run: Run
    keep: bool
    why: str


@dataclass(frozen=True, kw_only=True)
class PrunePlan:
    """Every archived run, newest first, with its verdict; the live folder's newest verified
    checkpoint; one message per entry of `archive/` that is not a run (left alone)."""

    verdicts: list[Verdict]
    live: str | None
    skipped: list[str] = field(default_factory=list)

    @property
    def doomed(self) -> list[Run]:
        return [v.run for v in self.verdicts if not v.keep]

    @property
    def kept(self) -> list[Run]:
        return [v.run for v in self.verdicts if v.keep]


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

    def archived(self) -> tuple[Entries, Names]:
        """The archived runs (`is_run`, sized with `du`), oldest first, and one message per
        other entry of `archive/` (left alone)."""
        entries = self.entries(self.archive_dir, sizes=True)
        skipped = [_not_a_run(self.archive_dir, e) for e in entries if not is_run(e)]
        return [e for e in entries if is_run(e)], skipped

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


# Run by the job's python in a folder holding `trainer/` (the current release): for each folder
# in argv, one JSON line [folder, its newest verified checkpoint's name or null], as a resume
# would find it.
VERIFY = """import json, sys
try:
    from trainer.model.checkpoint import find_resumable
except ImportError:  # a release deployed before the trainer was in folders
    from trainer.checkpoint import find_resumable
for folder in sys.argv[1:]:
    found = find_resumable(folder)
    print(json.dumps([folder, found.path.name if found.path is not None else None]), flush=True)
"""


def parse_verified(text: str) -> dict[str, str | None]:
    """`VERIFY`'s lines → {folder: newest verified checkpoint or None}; other lines (a
    library's chatter) are ignored."""
    found: dict[str, str | None] = {}
    for line in text.splitlines():
        try:
            folder, name = json.loads(line)
        except (ValueError, TypeError):
            continue
        if isinstance(folder, str) and (name is None or isinstance(name, str)):
            found[folder] = name
    return found


def choose(runs: Sequence[Run], *, keep: int, live: str | None) -> list[Verdict]:
    """The verdict on each archived run, newest first: the `keep` newest runs holding a verified
    checkpoint stay; when the live folder holds none (`live` is None), the newest run that does
    stays too, whatever `keep` says; everything else goes (a run without a verified checkpoint
    — a crash log, a run stopped before its first save — never counts among the kept)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise CheckpointPathError(f"--keep must be 0 or more, not {keep!r}.", hint="")
    newest_first = sorted(runs, key=lambda r: r.stamp, reverse=True)
    with_checkpoint = [r for r in newest_first if r.checkpoint is not None]
    kept = {r.stamp: f"one of the {keep} newest with a checkpoint" for r in with_checkpoint[:keep]}
    if live is None and with_checkpoint and with_checkpoint[0].stamp not in kept:
        kept[with_checkpoint[0].stamp] = "the newest checkpoint anywhere (the live folder has none)"
    verdicts = []
    for run in newest_first:
        if run.stamp in kept:
            verdicts.append(Verdict(run=run, keep=True, why=kept[run.stamp]))
        elif run.checkpoint is None:
            verdicts.append(Verdict(run=run, keep=False, why="no verified checkpoint"))
        else:
            verdicts.append(Verdict(run=run, keep=False, why=f"beyond the {keep} kept"))
    return verdicts


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
