"""`python -m dflash_ops …` is the `dflash` command; `main` is also the `dflash` script's entry.

The command's imports (typer, rich, every command module) take a moment at start-up: a Ctrl-C
then ends it as one during the command does, with one line and exit code 130, not a traceback
through the importer. Until they are done SIGINT is answered by a plain handler that writes that
line and leaves at once; then Python's own KeyboardInterrupt is back for the command, and one
that escapes it (a Ctrl-C while an error is being printed) ends the same way.

A command that ends with 130 leaves by `os._exit`, not through the interpreter's shutdown: under
`python -m`, CPython remembers a KeyboardInterrupt that once left source run by `exec` (dataclasses
and namedtuples build their methods so) and would end the process by SIGINT even though the
command handled it, so the exit code a shell or CI sees would not be 130.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from types import FrameType

INTERRUPTED = 130


def _leave(signum: int, frame: FrameType | None) -> None:
    os.write(2, b"Interrupted.\n")
    os._exit(INTERRUPTED)


def main() -> None:
    previous = signal.signal(signal.SIGINT, _leave)
    from dflash_ops.cli import main as run

    signal.signal(signal.SIGINT, previous)
    try:
        run()
    except KeyboardInterrupt:  # one that came while an error or a result was being said
        _leave(signal.SIGINT, None)
    except SystemExit as exc:
        if exc.code != INTERRUPTED:
            raise
        _flush()
        os._exit(INTERRUPTED)


def _flush() -> None:
    """What the command said is out before `os._exit`, which skips the interpreter's flush."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
            stream.flush()


if __name__ == "__main__":
    main()
