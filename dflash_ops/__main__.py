"""`python -m dflash_ops …` is the `dflash` command; `main` is also the `dflash` script's entry.

The command's imports (typer, rich, every command module) take a moment at start-up: a Ctrl-C
then ends it as one during the command does, with one line and exit code 130, not a traceback
through the importer.
"""

from __future__ import annotations

import sys


def main() -> None:
    try:
        from dflash_ops.cli import main as run
    except KeyboardInterrupt:
        sys.stderr.write("Interrupted.\n")
        sys.exit(130)
    run()


if __name__ == "__main__":
    main()
