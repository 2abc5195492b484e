"""Commands that run a trainer tool in the foreground at the place (`eval`, `plan`): its stdout
streams to ours as it comes; Ctrl-C ends it there too; a failure is one message from its stderr."""

from __future__ import annotations

from collections.abc import Callable

import typer

from dflash_ops.cli import output
from dflash_ops.connect.transport import StreamResult
from dflash_ops.errors import DflashError


def drain(
    stream: StreamResult, *, what: str, failure: Callable[[StreamResult], DflashError]
) -> int:
    """Copy the tool's stdout to ours until it ends; its exit code (the error printed first when
    it is not 0). `what` names the tool in the message of an interrupted run."""
    show = output.RemoteBytes()
    try:
        for chunk in stream:
            show(chunk)
    except KeyboardInterrupt:
        show.end()
        stream.close()
        output.info(f"Interrupted; the {what} was stopped.")
        raise typer.Exit(130) from None
    show.end()
    code = stream.exit_code or 0
    if code != 0:
        output.error(failure(stream))
    return code
