"""A command run on a real pseudo-terminal, as a person at a terminal runs it: what it prints is
read as it comes, keys are typed into it, and its exit status is read at the end."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Sequence
from pathlib import Path


def _controlling_tty() -> None:
    """`preexec_fn`: the pty (stdin) becomes the child's controlling terminal, in a session of
    its own, so that tmux and the kernel's job control see a terminal as a shell gives one.
    Ctrl-C and Ctrl-\\ get their default actions back, as a shell gives its foreground jobs: a
    suite started in the background by a non-interactive shell inherits them ignored, and the
    typed Ctrl-C would then reach nothing."""
    os.setsid()
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)
    for signum in (signal.SIGINT, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_DFL)


class Terminal:
    """`argv` on a 40×120 pty; `read_until` a pattern, `type` keys, `wait` for the exit code."""

    def __init__(
        self, argv: Sequence[str], *, cwd: Path, env: dict[str, str] | None = None
    ) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.master = master
        self.output = b""
        self.process = subprocess.Popen(
            list(argv), cwd=cwd, env={**os.environ, "TERM": "xterm", **(env or {})},
            stdin=slave, stdout=slave, stderr=slave, preexec_fn=_controlling_tty,
        )  # fmt: skip
        os.close(slave)

    def _pump(self, timeout: float) -> bool:
        """Read what is there (within `timeout`); False once the terminal is closed."""
        ready, _, _ = select.select([self.master], [], [], timeout)
        if not ready:
            return True
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: every process holding the pty has gone
            return False
        self.output += chunk
        return bool(chunk)

    def read_until(self, pattern: str | bytes, timeout: float = 30.0) -> bytes:
        """Everything printed so far, once `pattern` (a regex) is among it; AssertionError with
        the output after `timeout`."""
        wanted = re.compile(pattern.encode() if isinstance(pattern, str) else pattern)
        end = time.monotonic() + timeout
        while not wanted.search(self.output):
            closed = time.monotonic() > end or not self._pump(0.1)
            if closed and not wanted.search(self.output):
                raise AssertionError(f"{pattern!r} not seen in {self.output[-3000:]!r}")
        return self.output

    def type(self, keys: str | bytes) -> None:
        os.write(self.master, keys.encode() if isinstance(keys, str) else keys)

    def wait(self, timeout: float = 30.0) -> int:
        """The exit code, reading what is printed until then (the pty must be drained)."""
        end = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < end:
            self._pump(0.1)
        before = -1
        while len(self.output) != before:  # what it printed just before it exited
            before = len(self.output)
            self._pump(0.05)
        return self.process.wait(timeout=max(0.1, end - time.monotonic()))

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        os.close(self.master)

    @property
    def text(self) -> str:
        return self.output.decode("utf-8", "replace")
