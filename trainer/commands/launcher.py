"""torchrun that ends with 0 when the run stopped gracefully.

    python -m trainer launch --standalone --nproc-per-node 8 -m trainer train --config … --out …

The arguments are torchrun's (`torch.distributed.run`). torchrun forwards a SIGINT or SIGTERM it
receives to every worker, waits `--shutdown-timeout` seconds for them, then re-raises the signal
as an error (exit 1, a traceback), even when the workers finished their step, saved a checkpoint
and exited 0 (`trainer.base.stopping`). Its wait is set to `DFLASH_STOP_TIMEOUT` (what `dflash stop`
waits after SIGINT, exported by `launch.sh`) + 10 s through `TORCH_ELASTIC_SHUTDOWN_TIMEOUT`
unless that is set: the operator's SIGTERM, not torchrun's SIGKILL, ends a stop that takes too
long (torch versions without that variable keep their 30 s). Here the stopping rank leaves a record in a private file
(`DFLASH_STOP_RECORD`); when it is there after the signal, the launcher exits 0 — otherwise
128 + the signal, as a shell reports a process ended by it.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from pathlib import Path

from trainer.base.stopping import RECORD_ENV


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    args = sys.argv[1:] if argv is None else argv
    stop_timeout = os.environ.get("DFLASH_STOP_TIMEOUT", "")
    if stop_timeout.strip():
        wait = math.ceil(float(stop_timeout)) + 10
        os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(wait))
    with tempfile.TemporaryDirectory(prefix="dflash-stop-") as folder:
        record = Path(folder) / "stopped"
        os.environ[RECORD_ENV] = str(record)  # the workers inherit the launcher's environment
        try:
            torchrun(args)
        except SignalException as exc:
            if record.is_file():
                print(f"launcher: the workers stopped gracefully after {exc.sigval.name}")
                return 0
            print(f"launcher: stopped by {exc.sigval.name}", file=sys.stderr)
            return 128 + int(exc.sigval)
    return 0
