"""Commands that run a trainer tool in the foreground at the place (`eval`, `plan`): its stdout
streams to ours as it comes; Ctrl-C ends it there too; a failure is one message from its stderr."""

from __future__ import annotations

from collections.abc import Callable

import typer

from dflash_ops.cli import output
from dflash_ops.connect.transport import StreamResult
from dflash_ops.errors import DflashError


def copy(stream: StreamResult, *, what: str) -> int:
    """Copy the command's stdout to ours until it ends; its exit code. Ctrl-C stops it at the
    place too (exit 130); `what` names it in that message."""
    try:
        for chunk in stream:
            output.write_bytes(chunk)
    except KeyboardInterrupt:
        stream.close()
        output.info(f"Interrupted; the {what} was stopped.")
        raise typer.Exit(130) from None
    return stream.exit_code or 0


def drain(
    stream: StreamResult, *, what: str, failure: Callable[[StreamResult], DflashError]
) -> int:
    """`copy`, then the tool's error printed when its exit code is not 0."""
    code = copy(stream, what=what)
    if code != 0:
        output.error(failure(stream))
    return code
