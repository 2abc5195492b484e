"""What a command at a place may leave us and how long it may take: the readers that keep a
bounded part of its output (`Collector`: stdout's first bytes, stderr's last) and the clock
that says when its time is up (`Clock`: its timeout, or what its `Watch` allows as it goes).
Both transports run their commands with these (`connect/transport.py`).
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from typing import Protocol

CHUNK = 64 * 1024
STDOUT_CAP = 8 * 1024 * 1024  # bytes of stdout a command's Result keeps by default (the first)
STDERR_CAP = 64 * 1024  # bytes of stderr kept (the last: a failure says why at its end)
POLL = 0.2  # seconds between two looks at a Watch


class Watch(Protocol):
    """A running command's progress, for a bound that moves with it: `seen` gets each chunk of
    stdout as it arrives (from a reading thread), `left` says how many seconds the command may
    still take (0 or less: end it now)."""

    def seen(self, data: bytes) -> None: ...

    def left(self) -> float: ...


class Collector(threading.Thread):
    """Reads a stream to its end in the background (so two pipes never block each other),
    keeping its first `cap` bytes (`tail`: its last), counting the rest in `more`; `seen` gets
    every chunk."""

    def __init__(
        self,
        read: Callable[[int], bytes],
        *,
        cap: int,
        tail: bool = False,
        seen: Callable[[bytes], None] | None = None,
    ) -> None:
        super().__init__(daemon=True)
        self._read = read
        self._cap, self._tail, self._seen = cap, tail, seen
        self._kept = bytearray()
        self.more = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while chunk := self._read(CHUNK):
                if self._seen is not None:
                    self._seen(chunk)
                self._keep(chunk)
        except BaseException as exc:  # reported by whoever joins us
            self.error = exc

    def _keep(self, chunk: bytes) -> None:
        if self._tail:
            self._kept += chunk
            extra = len(self._kept) - self._cap
            if extra > 0:
                del self._kept[:extra]
                self.more += extra
            return
        room = max(0, self._cap - len(self._kept))
        self._kept += chunk[:room]
        self.more += max(0, len(chunk) - room)

    @property
    def data(self) -> bytes:
        return bytes(self._kept)


def collectors(
    out: Callable[[int], bytes], err: Callable[[int], bytes], cap: int, watch: Watch | None
) -> tuple[Collector, Collector]:
    """A command's stdout (its first `cap` bytes, shown to `watch`) and stderr (its last
    `STDERR_CAP`) readers, started."""
    readers = (
        Collector(out, cap=cap, seen=watch.seen if watch is not None else None),
        Collector(err, cap=STDERR_CAP, tail=True),
    )
    for reader in readers:
        reader.start()
    return readers


class TimeUp(Exception):
    """The command's time is up (its `timeout`, or what its `Watch` allows)."""


class Clock:
    """When a command's time is up: `timeout` after its start, or when its `watch` says so."""

    def __init__(self, timeout: float | None, watch: Watch | None) -> None:
        self.timeout = timeout
        self._deadline = None if timeout is None else time.monotonic() + timeout
        self._watch = watch

    def left(self) -> float | None:
        left = None if self._deadline is None else self._deadline - time.monotonic()
        if self._watch is not None:
            allowed = self._watch.left()
            left = allowed if left is None else min(left, allowed)
        return left

    def until(self, done: Callable[[float | None], bool]) -> None:
        """Call `done(seconds)`, which waits at most that long (None: for good) and says whether
        what it waits for has happened, until it has; `TimeUp` once the time is up. A watched
        command is looked at every `POLL` s (its bound moves as its output arrives)."""
        while True:
            left = self.left()
            if left is not None and left <= 0:
                raise TimeUp
            if done(left if self._watch is None else min(POLL, left or POLL)):
                return


def joined(thread: threading.Thread) -> Callable[[float | None], bool]:
    def done(seconds: float | None) -> bool:
        thread.join(seconds)
        return not thread.is_alive()

    return done


def exited(proc: subprocess.Popen[bytes], seconds: float | None) -> bool:
    try:
        proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return False
    return True
