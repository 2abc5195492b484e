"""What a command reads on stdin: bytes, a binary file object, or `HeldOpen` (bytes, then no end
of input while the command runs), fed to it in chunks by either transport (`transport`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

CHUNK = 64 * 1024


@dataclass(frozen=True)
class HeldOpen:
    """stdin `data`, then no end of input: the command's stdin stays open until it exits.

    Its stdin reaching EOF before then tells the command that whoever started it is gone (this
    process killed, the connection dropped): a long remote command watches it to stop acting
    on an authority it no longer has (`remote/site.sh`).
    """

    data: bytes = b""


Stdin = bytes | bytearray | memoryview | BinaryIO | HeldOpen | None


def chunks_of(stdin: Stdin) -> Iterator[bytes]:
    if stdin is None:
        return
    if isinstance(stdin, HeldOpen):
        stdin = stdin.data
    if isinstance(stdin, bytes | bytearray | memoryview):
        view = memoryview(stdin)
        for start in range(0, len(view), CHUNK):
            yield bytes(view[start : start + CHUNK])
        return
    while chunk := stdin.read(CHUNK):
        yield chunk
