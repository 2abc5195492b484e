"""`python -m dflash_ops …` is the `dflash` command; `main` is also the `dflash` script's entry.

The command's imports (typer, rich, every command module) take a moment at start-up: a Ctrl-C
then ends it as one during the command does, with one line and exit code 130, not a traceback
through the importer. Until they are done SIGINT is answered by a plain handler that writes that
line and leaves at once; then Python's own KeyboardInterrupt is back for the command, and one
that escapes it (a Ctrl-C while an error is being printed) ends the same way.
"""

from __future__ import annotations

import os
import signal
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


if __name__ == "__main__":
    main()
