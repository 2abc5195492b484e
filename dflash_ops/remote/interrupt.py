"""Ctrl-C while a changing command runs at a place (deploy, restart, rollback, stop).

Raising `KeyboardInterrupt` wherever the signal lands would drop the connection at any moment:
the place would then stop where it is, which after the running job was stopped means no job at
all. Instead, while `client.run` waits, SIGINT and SIGTERM are deferred: the first one lets go
of the command's held-open input (`HeldOpen.let_go`: its stdin ends, the connection stays), and
the site program decides (`remote/site.sh`, `hold_on`): before the stop it ends and leaves
everything as it was, from the stop on it goes on to start the job. Its answer is still read to
the end, so the caller can say which. A second signal raises `KeyboardInterrupt` at once.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from dflash_ops.connect.transport import HeldOpen

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupt:
    """Whether an interrupt came, and the input to let go of when it does."""

    def __init__(self, notice: Callable[[], None]) -> None:
        self.asked = False
        self._notice = notice
        self._held: HeldOpen | None = None

    def hold(self, held: HeldOpen) -> HeldOpen:
        """`held` is the input of the command now running (let go at once if asked already)."""
        self._held = held
        if self.asked:
            held.let_go()
        return held

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.asked:
            raise KeyboardInterrupt
        self.asked = True
        if self._held is not None:
            self._held.let_go()
        self._notice()


@contextmanager
def deferred(notice: Callable[[], None]) -> Iterator[Interrupt]:
    """SIGINT and SIGTERM go to an `Interrupt` while the block runs (in the main thread; a
    signal the process ignores stays ignored), the previous handlers after."""
    caught = Interrupt(notice)
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = {sig: signal.getsignal(sig) for sig in SIGNALS}
    for sig, was in previous.items():
        if was is not signal.SIG_IGN:
            signal.signal(sig, caught.handle)
    try:
        yield caught
    finally:
        for sig, was in previous.items():
            signal.signal(sig, was)
