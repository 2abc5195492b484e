"""`dflash exec -- CMD…`: one command at the place, as the job would run it.

In the current release's folder, with `[job] env` and what `launch.sh` exports for the job
(`DFLASH_RELEASE`, `DFLASH_CHECKPOINTS`, `DFLASH_PYTHON`, an empty `CUDA_VISIBLE_DEVICES` for
`[job] gpus = 0`, …), and the folder of the job's python first on PATH, so `python` and the
tools installed beside it are the job's. The argv travels as words (quoted only by
`shell.quote_argv` on the way), the command's stdout streams back as it comes, its stderr after
it ends, and its exit status is the command's own.
"""

from __future__ import annotations

from collections.abc import Sequence

from dflash_ops.commands.workspace import Workspace
from dflash_ops.connect.transport import StreamResult
from dflash_ops.errors import ConfigError
from dflash_ops.remote.launch import LaunchPlan, in_job


def exec_argv(ws: Workspace, argv: Sequence[str], *, release: str) -> list[str]:
    """The one remote command that runs `argv` in the job's environment of `release`."""
    plan = LaunchPlan.for_job(
        ws.config.job,
        release_id=release,
        python=ws.target.python,
        checkpoints=ws.target.checkpoints,
    )
    return in_job(plan, f"{ws.target.root}/current", ws.config.job.env, argv)


def start(ws: Workspace, argv: Sequence[str]) -> StreamResult:
    """Check that a release is deployed, then start `argv` there; the caller drains it."""
    if not argv:
        raise ConfigError(
            "No command to run.", hint="Name it after --, e.g. dflash exec -- python -V"
        )
    release = ws.releases().require_current()  # ReleaseError: "Deploy first"
    return ws.place.stream(exec_argv(ws, argv, release=release))
