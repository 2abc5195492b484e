"""Token shards: the on-disk format of target-generated data, read memory-mapped by the trainer.

A shard directory holds `manifest.json` and files `shard-00000.bin`, `shard-00001.bin`, …; each
shard file is self-describing:

    bytes 0…7    magic b"DFSHARD1"
    bytes 8…15   header length h (little-endian uint64)
    16…16+h      JSON header: {"samples": n, "tokens": t}
    (padded to a multiple of 64)
    offsets      int64[n + 1]: sample i is tokens[offsets[i]:offsets[i+1]]
    tokens       int32[t]     token ids
    loss_mask    uint8[t]     1 where the token is supervised (the target's own answer)

A shard is written to a temporary name, flushed to disk and renamed into place, so a file named
`shard-*.bin` is always complete; the reader still checks that the file's size is exactly what
its header says. The reader maps each file (`numpy.memmap`): only the samples a batch touches are
read, so a dataset larger than memory trains as well as a small one.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

import numpy as np

from trainer.base.errors import TrainerError
from trainer.base.files import fsync_path
from trainer.data.formats import Sample

MAGIC = b"DFSHARD1"
ALIGN = 64
MANIFEST = "manifest.json"
SHARD_RE = re.compile(r"^shard-(\d{5,})\.bin$")


class ShardError(TrainerError, ValueError):
    """A shard file or directory is not what the format says."""

    hint = "Generate the data again (python -m trainer generate …), or remove the broken shard."


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.bin"


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def write_shard(
    path: str | Path,
    samples: Sequence[tuple[Sequence[int], Sequence[bool]]],
    *,
    meta: dict[str, Any] | None = None,
) -> int:
    """Write (input_ids, loss_mask) pairs as one shard, atomically; returns the token count.
    `meta` (JSON) goes into the header: the shard's own counts, read back by `Shard.header`.

    Steps: write `<name>.tmp-<pid>` → fsync → rename to `<name>` → fsync the folder. A crash
    leaves only the temporary file, which `remove_temps` deletes and nothing reads."""
    path = Path(path)
    lengths = np.array([len(ids) for ids, _ in samples], dtype=np.int64)
    offsets = np.zeros(len(samples) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    total = int(offsets[-1])
    tokens = np.empty(total, dtype=np.int32)
    mask = np.empty(total, dtype=np.uint8)
    for (ids, sup), start, end in zip(samples, offsets[:-1], offsets[1:], strict=True):
        if len(ids) != len(sup):
            raise ShardError(f"{path.name}: a sample's input_ids and loss_mask differ in length")
        tokens[start:end] = ids
        mask[start:end] = sup
    header = json.dumps({**(meta or {}), "samples": len(samples), "tokens": total}).encode()
    head = MAGIC + struct.pack("<Q", len(header)) + header
    head += b"\0" * (_aligned(len(head)) - len(head))
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as fh:
        fh.write(head)
        fh.write(offsets.tobytes())
        fh.write(tokens.tobytes())
        fh.write(mask.tobytes())
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)
    return total


def remove_temps(folder: str | Path) -> list[Path]:
    """Delete temporary shard files left by an interrupted write; returns them."""
    gone = sorted(Path(folder).glob("shard-*.bin.tmp-*"))
    for path in gone:
        path.unlink(missing_ok=True)
    return gone


def finished_shards(folder: str | Path) -> dict[int, Path]:
    """Index → path of every complete shard file in `folder`."""
    found = {}
    for path in Path(folder).iterdir() if Path(folder).is_dir() else ():
        m = SHARD_RE.match(path.name)
        if m:
            found[int(m.group(1))] = path
    return dict(sorted(found.items()))


class Shard:
    """One shard file, memory-mapped: `len(shard)`, `shard[i]` → (input_ids, loss_mask)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as fh:
            start = fh.read(16)
            if len(start) < 16 or start[:8] != MAGIC:
                raise ShardError(f"{self.path}: not a dflash shard (bad magic)")
            (hlen,) = struct.unpack("<Q", start[8:])
            try:
                self.header: dict[str, Any] = json.loads(fh.read(hlen))
                header = self.header
                n, t = int(header["samples"]), int(header["tokens"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ShardError(f"{self.path}: unreadable shard header ({exc})") from exc
        base = _aligned(16 + hlen)
        want = base + 8 * (n + 1) + 5 * t
        if size != want:
            raise ShardError(f"{self.path}: {size} bytes, the header says {want} (truncated?)")
        self.offsets = np.memmap(self.path, np.int64, "r", offset=base, shape=(n + 1,))
        at = base + 8 * (n + 1)
        self.tokens = np.memmap(self.path, np.int32, "r", offset=at, shape=(t,)) if t else None
        self.mask = (
            np.memmap(self.path, np.uint8, "r", offset=at + 4 * t, shape=(t,)) if t else None
        )
        self.num_tokens = t

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def span(self, i: int) -> tuple[int, int]:
        return int(self.offsets[i]), int(self.offsets[i + 1])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        start, end = self.span(i)
        if self.tokens is None or self.mask is None:
            empty = np.zeros(0, dtype=np.int32)
            return empty, empty.astype(np.uint8)
        return self.tokens[start:end], self.mask[start:end]


class ShardSet:
    """All shards of a directory as one sequence of samples (memory-mapped, nothing loaded)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        paths = list(finished_shards(self.folder).values())
        if not paths:
            raise ShardError(f"{self.folder}: no shard-*.bin files")
        self.shards = [Shard(p) for p in paths]
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])  # (num_shards + 1,)

    def __len__(self) -> int:
        return int(self.starts[-1])

    def locate(self, i: int) -> tuple[Shard, int]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.shards[k], i - int(self.starts[k])

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        shard, j = self.locate(i)
        return shard[j]

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for shard in self.shards:
            for j in range(len(shard)):
                yield shard[j]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)


def is_shard_dir(path: str | Path) -> bool:
    """A directory with a manifest or shard files: `data.path` in the shard format."""
    p = Path(path)
    return p.is_dir() and ((p / MANIFEST).is_file() or bool(finished_shards(p)))


class ShardSamples(Sequence["Sample"]):
    """The trainer's view of a shard directory: a read-only sequence of `Sample`s, each built
    from the memory-mapped arrays when it is asked for (truncated to `max_len`). Slicing gives
    a view (`data.holdout` takes the last samples without reading them)."""

    def __init__(
        self,
        source: ShardSet | str | Path,
        *,
        max_len: int | None = None,
        rows: range | None = None,
    ) -> None:
        self.source = source if isinstance(source, ShardSet) else ShardSet(source)
        self.max_len = max_len
        self.rows = range(len(self.source)) if rows is None else rows

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def whole(self) -> bool:
        """Every sample of the folder, in order, uncut: the folder itself reads the same."""
        return self.rows == range(len(self.source)) and self.max_len is None

    @overload
    def __getitem__(self, i: int) -> Sample: ...

    @overload
    def __getitem__(self, i: slice) -> ShardSamples: ...

    def __getitem__(self, i: int | slice) -> Sample | ShardSamples:
        if isinstance(i, slice):
            return ShardSamples(self.source, max_len=self.max_len, rows=self.rows[i])
        ids, mask = self.source[self.rows[i]]
        if self.max_len is not None:
            ids, mask = ids[: self.max_len], mask[: self.max_len]
        return Sample(ids.tolist(), mask.astype(bool).tolist())
