"""A graceful stop: the first SIGINT or SIGTERM asks the run to stop, the second ends it.

`dflash stop` (and `restart`, `deploy`, `rollback`) send SIGINT to the job, then SIGTERM after
`[job] stop_timeout` seconds, then SIGKILL. Ending at the first signal would throw away every
step since the last periodic checkpoint, so the first one only sets a flag: the loop finishes
the step it is in (and a checkpoint write already under way), writes a verified checkpoint of
that step, logs `stopped at step N, checkpoint saved to …` and returns; the entry point exits 0.
A second signal raises `KeyboardInterrupt` at once (a checkpoint write it interrupts removes its
temp folder, so only complete checkpoints stay): the user, or the stop timeout, still wins.
Before the loop has started (`begin`) there is nothing to save, so the first signal already
ends the process: a stop right after a deploy does not wait for the target to load. It ends
there and then (`os._exit(130)`) rather than raising `KeyboardInterrupt` into whatever is
loading: torch's C module imports numpy and clears any error of that import, the interrupt
included, so a stop landing there was lost (the run trained on) or left numpy half-imported (a
crash a moment later).

Work that any moment may cut — its outputs written whole or not at all, like
`trainer.generation.generate`'s shards — has nothing to finish: `ending_at_once` ends it at the first
signal, from its imports on.

Split runs: torchrun forwards the signal to every worker (each in its own session); the ranks
agree on the step through the drafters' per-step all-reduce and the control store
(`trainer.split.segments`), and SIGTERM reaches `StopRequest.request` through the SIGTERM thread of
`trainer.split.distributed` (it is blocked in every other thread there).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import NoReturn

# The line a run logs when its loop begins, past loading the target and the data: `dflash
# deploy` (and restart) waits for it to say the job is past start-up (this module is torch-free,
# so the operator's side imports the words from here).
STARTED = "started training at step"


def started_line(step: int, steps: int) -> str:
    """`started training at step 0 of 1000`: the readiness line of a run."""
    return f"{STARTED} {step} of {steps}"


# Where `python -m trainer launch` (torchrun that exits 0 after a graceful stop) wants the
# stopping rank to write its "stopped" record; unset outside that launcher.
RECORD_ENV = "DFLASH_STOP_RECORD"


class StopRequest:
    """The stop flag of one process; `handling()` routes SIGINT/SIGTERM to it (main thread)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self.signal_name: str | None = None
        self.begun = False

    def begin(self) -> None:
        """From now on a signal asks for a graceful stop (training has started)."""
        self.begun = True

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def request(self, name: str) -> bool:
        """Ask the run to stop after its current step; False when it was asked before (the
        caller then ends the process)."""
        with self._lock:
            if self._event.is_set():
                return False
            self.signal_name = name
            self._event.set()
        print(
            f"{name} received: finishing the current step, then saving a checkpoint and exiting "
            "(send it again to end at once, without saving)",
            file=sys.stderr,
            flush=True,
        )
        return True

    @contextlib.contextmanager
    def handling(
        self, signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
    ) -> Iterator[StopRequest]:
        """Handle `signals` in this (the main) thread while the block runs: first → `request`
        (before `begin`: `end_at_once`), second → interrupt; the handlers before it are back
        afterwards."""
        with _handlers(signals, self._handle):
            yield self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if not self.begun:
            end_at_once(
                f"{name} received before the first step: nothing to save; interrupted "
                "(exit 130), start again with the same --out to train"
            )
        if not self.request(name):
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt


@contextlib.contextmanager
def ending_at_once(
    what: str, signals: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM)
) -> Iterator[None]:
    """While the block runs, `signals` end the process at once (`end_at_once`, exit 130) with
    the line `<SIGNAL> received: <what>`: for work that is safe to cut at any moment (its
    outputs written whole or not at all), from its imports on. Off the main thread (where
    handlers cannot be set) the block runs with the handlers as they are."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(signum: int, frame: FrameType | None) -> None:
        end_at_once(f"{signal.Signals(signum).name} received: {what}")

    with _handlers(signals, handle):
        yield


@contextlib.contextmanager
def _handlers(
    signals: tuple[signal.Signals, ...], handler: Callable[[int, FrameType | None], None]
) -> Iterator[None]:
    """`handler` for `signals` while the block runs; the ones before it are back afterwards
    (an in-process caller keeps its own Ctrl-C)."""
    before = {sig: signal.getsignal(sig) for sig in signals}
    for sig in signals:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, previous in before.items():
            if previous is not None:  # None: set outside Python, nothing to put back
                signal.signal(sig, previous)


def end_at_once(line: str) -> NoReturn:
    """Exit 130 at once, with nothing to unwind: no library code between the signal and the
    exit can catch it (torch's C module clears any error of its import of numpy, an interrupt
    included). The streams are flushed first; `line` goes straight to fd 2, since the signal
    may have landed inside a write to `sys.stderr`."""
    for stream in (sys.stdout, sys.stderr):
        # closed, or in the middle of the write the signal cut into
        with contextlib.suppress(OSError, ValueError, RuntimeError):
            stream.flush()
    os.write(2, (line + "\n").encode())
    os._exit(130)


def write_record(text: str) -> None:
    """Tell `trainer.commands.launcher` that this run stopped gracefully (a no-op outside it)."""
    path = os.environ.get(RECORD_ENV, "")
    if path:
        Path(path).write_text(text + "\n")
