"""`python -m dflash_ops …` is the `dflash` command."""

from dflash_ops.cli import main

main()
