"""Commands that run something in the foreground at the place (`eval`, `plan`, `exec`): its
stdout streams to ours as it comes; Ctrl-C ends it there too; a tool's failure is one message
from its stderr."""

from __future__ import annotations

from collections.abc import Callable

import typer

from dflash_ops.cli import output
from dflash_ops.connect.transport import StreamResult
from dflash_ops.errors import DflashError


def copy(stream: StreamResult, *, what: str, raw: bool = False) -> int:
    """Copy the command's stdout to ours until it ends (rendered visible, unchanged with `raw`);
    its exit code. Ctrl-C stops it at the place too (exit 130); `what` names it then."""
    show = output.RemoteBytes(raw=raw)
    try:
        for chunk in stream:
            show(chunk)
    except KeyboardInterrupt:
        show.end()
        stream.close()
        output.info(f"Interrupted; the {what} was stopped.")
        raise typer.Exit(130) from None
    show.end()
    return stream.exit_code or 0


def drain(
    stream: StreamResult, *, what: str, failure: Callable[[StreamResult], DflashError]
) -> int:
    """`copy`, then the tool's error printed when its exit code is not 0."""
    code = copy(stream, what=what)
    if code != 0:
        output.error(failure(stream))
    return code
