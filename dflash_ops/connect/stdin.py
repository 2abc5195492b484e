"""What a command reads on stdin: bytes, a binary file object, or `HeldOpen` (bytes, then no end
of input while the command runs), fed to it in chunks by either transport (`transport`)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

CHUNK = 64 * 1024


@dataclass(frozen=True)
class HeldOpen:
    """stdin `data`, then no end of input until the command exits or `let_go()` (the rest of
    `data` unsent, the output still read to the end).

    Its stdin reaching EOF before then tells the command that whoever started it is gone (this
    process killed, the connection dropped) or let go of it (an interrupt): a long remote
    command watches it to stop acting on an authority it no longer has (`remote/site.sh`).
    """

    data: bytes = b""
    ended: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

    def let_go(self) -> None:
        self.ended.set()


Stdin = bytes | bytearray | memoryview | BinaryIO | HeldOpen | None


def chunks_of(stdin: Stdin) -> Iterator[bytes]:
    if stdin is None:
        return
    held = stdin if isinstance(stdin, HeldOpen) else None
    source = stdin.data if isinstance(stdin, HeldOpen) else stdin
    if isinstance(source, bytes | bytearray | memoryview):
        view = memoryview(source)
        for start in range(0, len(view), CHUNK):
            if held is not None and held.ended.is_set():
                return  # let go of: the rest is not sent
            yield bytes(view[start : start + CHUNK])
        return
    while chunk := source.read(CHUNK):
        yield chunk


def let_go(stdin: Stdin) -> None:
    """End a held stdin (the writer then closes the command's input); anything else: nothing."""
    if isinstance(stdin, HeldOpen):
        stdin.let_go()
