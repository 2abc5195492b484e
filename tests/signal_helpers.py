"""When a process under test has set its own signal handlers."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path


def handlers_installed(proc: subprocess.Popen[str], timeout: float = 30) -> float:
    """The moment (`time.monotonic()`) `proc` handles SIGTERM itself, which Python leaves at its
    default: the trainer's and the generator's handlers set it, so SIGTERM's bit turns up in
    the caught-signals mask of `/proc/PID/status` once they are in."""
    status, end = Path(f"/proc/{proc.pid}/status"), time.monotonic() + timeout
    while True:
        caught = next(x for x in status.read_text().splitlines() if x.startswith("SigCgt:"))
        if int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1:
            return time.monotonic()
        assert proc.poll() is None and time.monotonic() < end, "no signal handler installed"
        time.sleep(0.005)
