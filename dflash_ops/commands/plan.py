"""`dflash plan`: run `python -m trainer plan` at the place, in the current release.

The planner times the target and the drafter alone and predicts every target/drafter split of the
node's GPUs. It runs in the foreground like `dflash eval` (from `<root>/current`, with the target's
python, the `[job] env` and the release's own `train.toml`), so it measures the model and sequence
settings the job trains with. Timings taken while the job holds the same GPUs say nothing about
either role alone (and the extra models may not fit), so a running job is refused unless forced.
`--out` is the checkpoints folder, as for the job: a demo config then reuses the job's demo assets
beside it.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflash_ops.commands.workspace import Workspace
from dflash_ops.connect.transport import StreamResult
from dflash_ops.errors import JobRunning, RemoteCommandFailed
from dflash_ops.remote.launch import in_release, verb

SHOWN_ARGV = ("python", "-m", "trainer", "plan")  # how a failure names the command


@dataclass(frozen=True, kw_only=True)
class PlanRequest:
    gpus: int | None = None  # None: `[job] gpus`, else the GPUs the planner sees
    steps: int | None = None  # timed batches per role (None: the planner's default)
    warmup: int | None = None  # untimed batches per role
    as_json: bool = False
    force: bool = False  # run even while the job runs


def planner_argv(ws: Workspace, request: PlanRequest) -> list[str]:
    """`bash -c 'cd current; exec …' env K=V… python -m trainer plan …` as one argv."""
    args = [
        ws.target.python, *verb("plan", "--out", ws.target.checkpoints),
    ]  # fmt: skip
    gpus = request.gpus if request.gpus is not None else ws.config.job.gpus or None
    for flag, value in (("--gpus", gpus), ("--steps", request.steps), ("--warmup", request.warmup)):
        if value is not None:
            args += [flag, str(value)]
    if request.as_json:
        args.append("--json")
    current = f"{ws.target.root}/current"
    return in_release(current, ws.config.job.env, args, name="dflash-plan")


def start(ws: Workspace, request: PlanRequest) -> StreamResult:
    """Check that there is a release and that the GPUs are free, then start the planner; the
    caller drains the stream."""
    ws.releases().require_trainer("dflash plan")  # ReleaseError: "Deploy first", no entry
    if not request.force and ws.job().state().running:
        raise JobRunning(
            f"The job {ws.config.job.session!r} is running on {ws.target.describe()}: timing the "
            "roles on busy GPUs measures the job, not them, and may run out of memory.",
            hint="Stop it first with: dflash stop (or pass --force to time anyway).",
        )
    return ws.place.stream(planner_argv(ws, request))


def failure(ws: Workspace, stream: StreamResult) -> RemoteCommandFailed:
    """The error of a finished planner run that exited non-zero: its last stderr line."""
    return RemoteCommandFailed(
        ws.target.describe(),
        SHOWN_ARGV,
        stream.exit_code if stream.exit_code is not None else -1,
        stream.stderr.decode("utf-8", "backslashreplace"),
        hint="Fix what it names, then run again (python -m trainer plan --help at the place).",
    )
