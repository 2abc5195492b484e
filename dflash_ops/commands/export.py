"""`dflash export`: run `python -m trainer export` at the place and stream the folder back.

At the place, in ONE command: `cd <root>/current` with the `[job] env`, run the exporter on the
release's `train.toml` into a temporary folder inside the checkpoints folder (its messages go to
stderr), then `tar -c` that folder to stdout and remove it (a `trap`, also when anything
fails). With `--keep-remote` the folder is written to `<checkpoints>/exports/<name>` instead
and stays. Here, the tar stream is unpacked as it arrives into `.<to>.tmp-<pid>` next to
`--to` (only plain files inside one top folder are accepted) and renamed to `--to` once the
exporter has exited 0 and both files are there: an interrupted export leaves nothing at `--to`.
"""

from __future__ import annotations

import datetime as dt
import io
import os
import shutil
import tarfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_ops.commands.eval import FIX_HINT, require_checkpoint
from dflash_ops.commands.workspace import Workspace
from dflash_ops.connect.transport import StreamResult
from dflash_ops.errors import ExportError
from dflash_ops.remote.launch import in_release, verb
from dflash_ops.untrusted import last_line

FILES = ("config.json", "model.safetensors")
DTYPES = ("bf16", "fp16", "fp32")
# $1 parent folder, $2 the export's name, $3 keep (1/0), then the exporter's argv (no --out).
_SCRIPT = r"""set -euo pipefail
parent=$1 name=$2 keep=$3
shift 3
mkdir -p -- "$parent"
if [ "$keep" != 1 ]; then
  parent=$(mktemp -d -- "$parent/.export-XXXXXX")
  trap 'rm -rf -- "$parent"' EXIT
  trap 'exit 143' TERM HUP INT
fi
"$@" --out "$parent/$name" >&2
tar -C "$parent" -cf - -- "$name"
"""


@dataclass(frozen=True, kw_only=True)
class ExportRequest:
    to: Path  # the local folder to create
    checkpoint: str | None = None  # None: the checkpoints folder (its newest verified one)
    dtype: str = "bf16"
    keep_remote: bool = False


def remote_name(checkpoint: str, now: dt.datetime | None = None) -> str:
    """`<checkpoint folder name>-<UTC time>`: where `--keep-remote` leaves the copy."""
    stamp = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")
    return f"{Path(checkpoint).name}-{stamp}"


def exporter_argv(
    ws: Workspace, request: ExportRequest, *, checkpoint: str, kept: str | None
) -> list[str]:
    """The one remote command: the script above inside the current release, with the env.
    `kept` is the folder `--keep-remote` writes (None: a temporary one, removed)."""
    if kept is not None:
        parent, name, keep = str(Path(kept).parent), Path(kept).name, "1"
    else:
        parent, name, keep = ws.target.checkpoints, "drafter", "0"
    tool = [
        ws.target.python, *verb("export", "--checkpoint", checkpoint, "--dtype", request.dtype),
    ]  # fmt: skip
    script = ["bash", "-c", _SCRIPT, "dflash-export", parent, name, keep, *tool]
    return in_release(f"{ws.target.root}/current", ws.config.job.env, script, name="dflash-export")


def staging(to: Path) -> Path:
    """Create the temporary folder next to `to` that the stream is unpacked into."""
    to = Path(to).absolute()
    if to.exists():
        raise ExportError(f"{to} exists.", hint="Choose a new --to folder, or remove that one.")
    to.parent.mkdir(parents=True, exist_ok=True)
    tmp = to.with_name(f".{to.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def discard(tmp: Path) -> None:
    """Remove a staging folder (an interrupted export)."""
    shutil.rmtree(tmp, ignore_errors=True)


def start(ws: Workspace, request: ExportRequest) -> tuple[StreamResult, str | None]:
    """Check the release and the checkpoint, then start the remote command; returns the stream
    and the folder `--keep-remote` leaves at the place (None without it)."""
    if request.dtype not in DTYPES:
        raise ExportError(f"--dtype {request.dtype!r} is not one of {', '.join(DTYPES)}.")
    ws.releases().require_trainer("dflash export")  # ReleaseError: "Deploy first", no entry
    checkpoint = require_checkpoint(ws, request.checkpoint, ExportError)
    kept = None
    if request.keep_remote:
        kept = f"{ws.target.checkpoints}/exports/{remote_name(checkpoint)}"
    argv = exporter_argv(ws, request, checkpoint=checkpoint, kept=kept)
    return ws.place.stream(argv), kept


class _ChunkReader(io.RawIOBase):
    """The stream's chunks as a file for `tarfile`'s stream mode; counts what it hands out."""

    def __init__(self, chunks: Iterator[bytes], on_bytes: Callable[[int], None]) -> None:
        self._chunks = chunks
        self._buf = b""
        self._on_bytes = on_bytes

    def readable(self) -> bool:
        return True

    def readinto(self, b: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._buf:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._buf = chunk
            self._on_bytes(len(chunk))
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n


def _unpack(reader: io.RawIOBase, tmp: Path) -> None:
    """Plain files of one top folder only, written under `tmp` (the top folder's name dropped)."""
    with tarfile.open(fileobj=io.BufferedReader(reader), mode="r|") as tar:
        top = None
        for member in tar:
            parts = member.name.split("/")
            top = top or parts[0]
            if member.isdir() and parts == [top]:
                continue
            if not (member.isfile() and len(parts) == 2 and parts[0] == top):
                raise ExportError(f"Refusing tar entry {member.name!r} from the place.")
            if parts[1] in ("", ".", ".."):
                raise ExportError(f"Refusing tar entry {member.name!r} from the place.")
            source = tar.extractfile(member)
            assert source is not None
            with open(tmp / parts[1], "wb") as fh:
                shutil.copyfileobj(source, fh, 1 << 20)
                fh.flush()
                os.fsync(fh.fileno())


def receive(stream: StreamResult, tmp: Path, to: Path, *, on_bytes: Callable[[int], None]) -> Path:
    """Unpack the stream into `tmp`, check the exporter's exit and files, rename to `to`.
    Anything failing (or Ctrl-C) removes `tmp` and leaves `to` absent."""
    try:
        _unpack(_ChunkReader(stream, on_bytes), tmp)
        code = stream.wait()
        if code != 0:
            raise failure(stream)
        missing = [f for f in FILES if not (tmp / f).is_file()]
        if missing:
            raise ExportError(f"The exported folder has no {', '.join(missing)}.")
        os.rename(tmp, Path(to).absolute())
    except tarfile.ReadError as exc:
        code = stream.wait()
        raise (failure(stream) if code else ExportError(f"Bad tar stream: {exc}")) from None
    finally:
        stream.close()
        discard(tmp)
    return Path(to)


def failure(stream: StreamResult) -> ExportError:
    """The error of an exporter run that exited non-zero: its last stderr line."""
    detail = last_line(stream.stderr.decode("utf-8", "backslashreplace"))
    return ExportError(
        f"The exporter failed (exit {stream.exit_code}): {detail}",
        hint=FIX_HINT,
    )
