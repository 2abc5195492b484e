"""The checkpoints folder at a place: list it, and archive it before a fresh run.

Nothing is deleted here. A fresh run (`deploy` without `--resume`, `restart --clean`) moves every
entry of the folder — checkpoints, metrics, the previous run's log — into
`<checkpoints>/archive/<UTC time>/` by rename (same filesystem: instant, whatever the size), so
the trainer starts from an empty folder and the old run can still be recovered.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflash_ops import shell
from dflash_ops.errors import CheckpointPathError, UnsafeValue

if TYPE_CHECKING:
    from dflash_ops.place import Place

ARCHIVE = "archive"

# Names of the entries of folder $1, NUL-separated; nothing when the folder does not exist.
_ENTRIES = (
    '[ -d "$1" ] || exit 0\n'
    'cd -- "$1" && find . -mindepth 1 -maxdepth 1 -printf "%f\\t%y\\t%s\\t%T@\\0"\n'
)


@dataclass(frozen=True, kw_only=True)
class Entry:
    name: str
    kind: str  # "f" file, "d" folder, "l" link, … (find's %y)
    size: int  # bytes (for folders: the folder entry itself)
    mtime: float


@dataclass(frozen=True, kw_only=True)
class Listing:
    live: list[Entry]
    archived: dict[str, list[Entry]]  # archive stamp → its entries


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

    def entries(self, folder: str | None = None) -> list[Entry]:
        result = self.place.run(["bash", "-c", _ENTRIES, "dflash-ls", folder or self.path])
        entries = []
        for record in result.stdout.decode("utf-8", "surrogateescape").split("\0"):
            if not record:
                continue
            name, kind, size, mtime = record.rsplit("\t", 3)
            entries.append(Entry(name=name, kind=kind, size=int(size), mtime=float(mtime)))
        return sorted(entries, key=lambda e: e.name)

    def archive(self, *, now: dt.datetime | None = None) -> str | None:
        """Move every entry except `archive/` into `archive/<UTC time>/`; returns that folder.

        Returns None when there was nothing to move.
        """
        live = [e.name for e in self.entries() if e.name != ARCHIVE]
        if not live:
            return None
        now = now or dt.datetime.now(dt.UTC)
        dest = f"{self.archive_dir}/{now:%Y%m%dT%H%M%S}.{now.microsecond // 1000:03d}Z"
        sources = [self._inside(name) for name in live]
        self.place.run(["mkdir", "-p", "--", dest])
        self.place.run(["mv", "--", *sources, dest + "/"])
        return dest

    def list(self) -> Listing:
        live = [e for e in self.entries() if e.name != ARCHIVE]
        archived = {
            stamp.name: self.entries(f"{self.archive_dir}/{stamp.name}")
            for stamp in self.entries(self.archive_dir)
            if stamp.kind == "d"
        }
        return Listing(live=live, archived=archived)

    def _inside(self, name: str) -> str:
        """The path of entry `name`, proven to be directly inside the folder."""
        if not name or "/" in name or name in (".", "..") or "\0" in name:
            raise CheckpointPathError(f"Refusing to move {name!r}: not an entry of {self.path}.")
        return f"{self.path}/{name}"
