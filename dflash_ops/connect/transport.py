"""Run an argv somewhere and collect its exit code and output: a local subprocess or SSH.

Both transports give the same contract:
- `run(argv, stdin=…, timeout=…, cap=…, watch=…) -> Result`: stdin (`stdin.Stdin`) is copied
  in chunks while stdout and stderr are read concurrently (a command that writes more than a
  pipe or channel window holds never blocks against us); `watch` sees stdout as it comes.
- `stream(argv) -> StreamResult`: an iterator of stdout chunks as they arrive. When it is
  exhausted, `exit_code` and `stderr` are set on it; `close()` abandons the command early.
- A program that does not exist exits 127 and one killed by a signal exits 128+signal (local)
  or -1 (SSH: the server reports a signal, not a status), as a shell would report.
- What is kept of the output is bounded (`bounded.py`): stdout's first `cap` bytes, stderr's
  last `STDERR_CAP`, the rest counted in `Result.stdout_more`/`stderr_more`: a place that
  prints without end costs time, never memory. `timeout` bounds the command, a `Watch` moves
  its bound as its stdout arrives; time up: the command is ended (locally its process group
  killed; over SSH its channel closed), its stdin closed, `CommandTimedOut` raised.

`SSHTransport` holds ONE paramiko connection, opened on first use and shared by every command
(each command is a channel on it). `connections_opened` counts real connections. If the
connection dies, the command in flight raises `ConnectionFailed` (`ConnectionDropped` once the
keepalive declared a silent peer dead); `reconnect()` opens a new one.
Commands never get a pty: bytes on stdin/stdout must pass unchanged.
"""

from __future__ import annotations

import contextlib
import io
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Protocol, runtime_checkable

from dflash_ops.connect import shell
from dflash_ops.connect.bounded import (
    CHUNK,
    STDERR_CAP,
    STDOUT_CAP,
    Clock,
    Collector,
    TimeUp,
    Watch,
    collectors,
    exited,
    joined,
)
from dflash_ops.connect.stdin import HeldOpen, Stdin, chunks_of, let_go
from dflash_ops.errors import CommandTimedOut, ConnectionFailed
from dflash_ops.untrusted import more

if TYPE_CHECKING:  # paramiko (~0.1-0.3 s to import) loads only when an SSH command runs
    import paramiko

    from dflash_ops.connect.ssh_config import SSHTarget
    from dflash_ops.connect.ssh_connect import Connection


@dataclass(frozen=True)
class Result:
    """What a finished command left behind (`stdout_more`/`stderr_more`: bytes read beyond what
    was kept, after the kept stdout and before the kept stderr)."""

    argv: tuple[str, ...]
    exit_code: int
    stdout: bytes
    stderr: bytes
    stdout_more: int = 0
    stderr_more: int = 0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    @property
    def stdout_text(self) -> str:
        return self.stdout.decode("utf-8", errors="backslashreplace")

    @property
    def stderr_text(self) -> str:
        """stderr as text, after a first line saying how much came before it, if anything."""
        text = self.stderr.decode("utf-8", errors="backslashreplace")
        return f"{more(self.stderr_more)} before this:\n{text}" if self.stderr_more else text


@runtime_checkable
class Transport(Protocol):
    description: str
    connections_opened: int

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin = None,
        timeout: float | None = None,
        cap: int = STDOUT_CAP,
        watch: Watch | None = None,
    ) -> Result: ...

    def stream(self, argv: Sequence[str]) -> StreamResult: ...

    def connect(self) -> None: ...  # open the connection now (nothing to do locally)

    def close(self) -> None: ...


class StreamResult(Iterator[bytes]):
    """stdout chunks of a running command; `exit_code`/`stderr` are set once it is exhausted.

    `exit_code` stays None until the iterator has ended (or `wait()` has returned).
    """

    def __init__(
        self,
        argv: Sequence[str],
        chunks: Iterator[bytes],
        finish: Callable[[], tuple[int, bytes]],
        abort: Callable[[], None],
    ) -> None:
        self.argv = tuple(argv)
        self.exit_code: int | None = None
        self.stderr = b""
        self._chunks = chunks
        self._finish = finish
        self._abort = abort
        self._done = False

    def __iter__(self) -> StreamResult:
        return self

    def __next__(self) -> bytes:
        if self._done:
            raise StopIteration
        try:
            return next(self._chunks)
        except StopIteration:
            self._done = True
            self.exit_code, self.stderr = self._finish()
            raise

    def wait(self) -> int:
        """Read (and drop) the remaining output; return the exit code."""
        for _ in self:
            pass
        assert self.exit_code is not None
        return self.exit_code

    def close(self) -> None:
        """Stop reading and end the command if it still runs."""
        if not self._done:
            self._done = True
            self._abort()

    def __enter__(self) -> StreamResult:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# A stream's reader wakes this often while nothing arrives. The terminal's SIGINT goes to one
# thread of the process, not always the main one, and Python raises KeyboardInterrupt only when
# the main thread runs again: blocked in a read of a quiet log, it would never see the Ctrl-C.
WAKE = 0.25


def _pipe(stream: IO[bytes] | None) -> io.BufferedReader:
    """One of Popen's pipes as what it is (a buffered reader, whose `read1` returns what has
    arrived rather than waiting for a full chunk)."""
    assert isinstance(stream, io.BufferedReader)
    return stream


def _result(args: tuple[str, ...], code: int, out: Collector, err: Collector) -> Result:
    return Result(args, code, out.data, err.data, stdout_more=out.more, stderr_more=err.more)


def _argv(argv: Sequence[str]) -> tuple[str, ...]:
    """Check the argv once, up front, the same way for both transports."""
    shell.quote_argv(argv)  # refuses NUL bytes, empty argv, non-str elements
    return tuple(argv)


class LocalTransport:
    """Runs commands as subprocesses of this process (no shell)."""

    description = "local"

    def __init__(self, *, cwd: Path | None = None) -> None:
        self.cwd = cwd
        self.connections_opened = 0

    def _spawn(self, argv: tuple[str, ...], stdin: int) -> subprocess.Popen[bytes] | None:
        try:
            return subprocess.Popen(
                argv,
                stdin=stdin,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                cwd=self.cwd,
                start_new_session=True,  # a Ctrl-C at our terminal is not the command's
            )
        except FileNotFoundError:
            return None

    @staticmethod
    def _status(code: int) -> int:
        return 128 - code if code < 0 else code  # -SIGKILL → 137, like a shell

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin = None,
        timeout: float | None = None,
        cap: int = STDOUT_CAP,
        watch: Watch | None = None,
    ) -> Result:
        args = _argv(argv)
        proc = self._spawn(args, subprocess.PIPE)
        if proc is None:
            return Result(args, 127, b"", f"{args[0]}: command not found\n".encode())
        assert proc.stdin
        out, err = collectors(_pipe(proc.stdout).read1, _pipe(proc.stderr).read1, cap, watch)
        writer = threading.Thread(target=self._feed, args=(proc, stdin), daemon=True)
        writer.start()
        clock = Clock(timeout, watch)
        try:
            clock.until(lambda seconds: exited(proc, seconds))
            let_go(stdin)  # the writer closes the command's stdin
            # Output ends when the last holder of the pipes exits, which may be a background
            # child of the command: that is bounded by the same clock.
            for thread in (writer, out, err):
                clock.until(joined(thread))
        except TimeUp:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            let_go(stdin)
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.close()  # what it left running sees its caller gone (`HeldOpen`)
            proc.wait()
            raise CommandTimedOut(f"{args[0]} did not finish in time locally") from None
        finally:
            let_go(stdin)
        return _result(args, self._status(proc.returncode), out, err)

    @staticmethod
    def _feed(proc: subprocess.Popen[bytes], stdin: Stdin) -> None:
        assert proc.stdin is not None
        try:
            for chunk in chunks_of(stdin):
                proc.stdin.write(chunk)
            if isinstance(stdin, HeldOpen):
                proc.stdin.flush()
                stdin.ended.wait()  # until the command exited, or we let go of it
            proc.stdin.close()
        except (BrokenPipeError, ValueError):
            pass  # the command exited without reading all of its input, as `head` does

    def stream(self, argv: Sequence[str]) -> StreamResult:
        args = _argv(argv)
        proc = self._spawn(args, subprocess.DEVNULL)
        if proc is None:
            missing = f"{args[0]}: command not found\n".encode()
            return StreamResult(args, iter(()), lambda: (127, missing), lambda: None)
        out = _pipe(proc.stdout).fileno()
        err = Collector(_pipe(proc.stderr).read1, cap=STDERR_CAP, tail=True)
        err.start()

        def chunks() -> Iterator[bytes]:
            while True:
                if not select.select([out], [], [], WAKE)[0]:
                    continue  # `WAKE`: a Ctrl-C taken by another thread is raised here
                chunk = os.read(out, CHUNK)
                if not chunk:
                    return
                yield chunk

        def finish() -> tuple[int, bytes]:
            proc.wait()
            err.join()
            return self._status(proc.returncode), err.data

        def abort() -> None:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait()
            err.join()

        return StreamResult(args, chunks(), finish, abort)

    def connect(self) -> None:
        pass

    def close(self) -> None:
        pass


class SSHTransport:
    """Runs commands over one SSH connection, opened lazily and reused for every command.

    `host` is an alias or address resolved with `ssh_config.resolve` (explicit `user`, `port`,
    `identity_files`, `proxy_jump` win over ~/.ssh/config), or an already resolved `SSHTarget`.
    `accept_new_host_key=True` is the CLI's `--accept-new-host-key`: an unknown host key is
    added to the user's known_hosts instead of refused. A changed key is always refused.
    """

    def __init__(
        self,
        host: str | SSHTarget,
        *,
        user: str | None = None,
        port: int | None = None,
        identity_files: Sequence[Path] | None = None,
        proxy_jump: str | None = None,
        accept_new_host_key: bool = False,
    ) -> None:
        from dflash_ops.connect.ssh_config import SSHTarget, resolve

        if isinstance(host, SSHTarget):
            self.target = host
        else:
            self.target = resolve(
                host,
                user=user,
                port=port,
                identity_files=None if identity_files is None else tuple(identity_files),
                proxy_jump=proxy_jump,
            )
        self.accept_new_host_key = accept_new_host_key
        self.description = self.target.description
        self.connections_opened = 0
        self._conn: Connection | None = None
        self._lock = threading.Lock()

    def _connection(self) -> Connection:
        with self._lock:
            if self._conn is None:
                from dflash_ops.connect.ssh_connect import connect

                self._conn = connect(self.target, accept_new_host_key=self.accept_new_host_key)
                self.connections_opened += 1
            elif not self._conn.is_active():
                raise self._conn.dropped(self.description) or ConnectionFailed(
                    f"The connection to {self.description} was lost",
                    hint="Call reconnect() (the CLI does so with backoff) or run the command again.",
                )
            return self._conn

    def connect(self) -> None:
        """Open the connection now (host key check, authentication) without running a command:
        each command starts the user's shell at the server, which can cost more than the rest."""
        self._connection()

    def reconnect(self) -> None:
        """Drop the current connection (if any) and open a new one now."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        self._connection()

    @property
    def connected(self) -> bool:
        return self._conn is not None and self._conn.is_active()

    def _open(self, args: tuple[str, ...]) -> paramiko.Channel:
        import paramiko

        conn = self._connection()
        wait = max(self.target.connect_timeout, self.target.alive.bound + 1)  # keepalive first
        try:
            channel = conn.transport.open_session(timeout=wait)
            channel.exec_command(shell.quote_argv(args))
        except (paramiko.SSHException, OSError, EOFError) as exc:
            raise self._lost(args, exc) from None
        return channel

    def _lost(self, args: tuple[str, ...], exc: BaseException | None = None) -> ConnectionFailed:
        if self._conn is not None and (dropped := self._conn.dropped(self.description, args[0])):
            return dropped
        why = f": {exc}" if exc else ""
        return ConnectionFailed(
            f"The connection to {self.description} was lost while running {args[0]}{why}",
            hint="The command may or may not have finished there; reconnect and check its state.",
        )

    def _exit_status(self, channel: paramiko.Channel, args: tuple[str, ...]) -> int:
        code = channel.recv_exit_status()
        if code != -1:
            return code
        # -1: no exit status came. Either the command died of a signal (the server then sends
        # EOF first) or the connection is gone (paramiko closes channels slightly before it
        # marks the transport inactive, so give it a moment).
        for _ in range(20):
            if not (self._conn and self._conn.is_active()):
                raise self._lost(args)
            if channel.eof_received:
                return code
            time.sleep(0.05)
        raise self._lost(args)

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin = None,
        timeout: float | None = None,
        cap: int = STDOUT_CAP,
        watch: Watch | None = None,
    ) -> Result:
        args = _argv(argv)
        clock = Clock(timeout, watch)
        channel = self._open(args)
        out, err = collectors(channel.recv, channel.recv_stderr, cap, watch)
        writer = threading.Thread(target=self._feed, args=(channel, stdin), daemon=True)
        writer.start()
        try:
            for thread in (out, err, writer):  # a held stdin ends once the output has
                if thread is writer:
                    let_go(stdin)
                clock.until(joined(thread))
            code = self._exit_status(channel, args)
        except TimeUp:
            # Closing the channel closes the command's stdin at the server: what watches it
            # (`HeldOpen`) ends there.
            raise CommandTimedOut(
                f"{args[0]} did not finish in time on {self.description}"
            ) from None
        finally:
            let_go(stdin)
            channel.close()
        if out.error or err.error:
            raise self._lost(args, out.error or err.error)
        return _result(args, code, out, err)

    @staticmethod
    def _feed(channel: paramiko.Channel, stdin: Stdin) -> None:
        import paramiko

        try:
            for chunk in chunks_of(stdin):
                channel.sendall(chunk)
            if isinstance(stdin, HeldOpen):
                stdin.ended.wait()  # until the command exited, or we let go of it
            channel.shutdown_write()
        except (OSError, EOFError, paramiko.SSHException):
            pass  # the command ended (or the connection died) before reading all input

    def stream(self, argv: Sequence[str]) -> StreamResult:
        import paramiko

        args = _argv(argv)
        channel = self._open(args)
        channel.shutdown_write()
        err = Collector(channel.recv_stderr, cap=STDERR_CAP, tail=True)
        err.start()

        def chunks() -> Iterator[bytes]:
            while True:
                if not select.select([channel], [], [], WAKE)[0]:
                    continue  # as for a local stream: a Ctrl-C is seen within WAKE seconds
                try:
                    chunk = channel.recv(CHUNK)
                except (OSError, EOFError, paramiko.SSHException) as exc:
                    raise self._lost(args, exc) from None
                if not chunk:
                    return
                yield chunk

        def finish() -> tuple[int, bytes]:
            err.join()
            try:
                return self._exit_status(channel, args), err.data
            finally:
                channel.close()

        def abort() -> None:
            channel.close()

        return StreamResult(args, chunks(), finish, abort)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
