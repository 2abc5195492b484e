"""What each command does, in order, on a `Workspace`. The CLI only parses and prints.

deploy:  build the bundle; then, at the place in ONE command (`remote/site.sh deploy`): check tmux and
         python → take the lock → push it (one tar stream) → check it → stop the running job →
         switch `current` → keep the last 5 → archive the checkpoints (unless resuming) → start
         the job → release the lock → wait until it is past start-up; remember the target in
         `.dflash/state.json`. Ctrl-C before the stop changes nothing; from the stop on the
         command goes to the end (`remote/interrupt.py`).
restart: stop → archive (with `--clean`) → start the job of the current release (one command).
rollback: stop → switch `current` to an earlier complete release → start (resuming; one command).
stop:    SIGINT, SIGTERM, SIGKILL to the job's process group, then end the session (one command).

deploy, restart, rollback and stop hold the target's deploy lock (`remote/lock.py`) while they act, so
two of them never interleave; `force` takes over a lock whose holder is gone.
status:  the session's state, the release, the last log lines and the trainer's last metrics;
         the place's GPUs from `nvidia-smi` with the role and memory of the ranks on each, and
         per-role rates of a split run (`gpus.py`).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from dflash_ops.commands import doctor, environment, gpus
from dflash_ops.commands.checks import Setup
from dflash_ops.commands.probes import probed_devices
from dflash_ops.commands.workspace import Workspace
from dflash_ops.errors import JobEndedAtStartUp
from dflash_ops.remote import client
from dflash_ops.remote.job import JobState, StartUp
from dflash_ops.remote.launch import LaunchPlan
from dflash_ops.remote.release import build_bundle, new_release_id
from dflash_ops.settings import state

log = logging.getLogger(__name__)
Say = Callable[[str], None]
FORCE_RESUME_ENV = "DFLASH_FORCE_RESUME"  # read by trainer.commands.train
# The trainer's readiness line, as it logs it (`trainer.base.stopping.started_line`): the job is past
# start-up (tests/system/test_startup.py deploys the real trainer and waits for it).
STARTED = "started training at step"
STATUS_LOG_CAP = 64 * 1024  # bytes of the log's end `status` reads for its last lines
METRICS_CAP = 1024 * 1024  # bytes of the last metrics row read (a row is well under)


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True, kw_only=True)
class DeployReport:
    release: str
    removed: list[str]
    stopped: JobState | None
    archived: str | None
    started: JobState
    startup: StartUp | None = None  # None: not waited for (`wait=False`, `start_wait = 0`)
    interrupted: bool = False  # Ctrl-C came once the old job was stopping: the deploy went on
    devices: int = 0  # NVIDIA GPUs at the place (counted by the python probe of a CPU job)


@dataclass(frozen=True, kw_only=True)
class RestartReport:
    release: str
    stopped: JobState | None
    archived: str | None
    started: JobState
    startup: StartUp | None = None
    interrupted: bool = False
    cleaned: list[str] = field(default_factory=list)  # `<id>.tmp` left by killed deploys


def start_wait(ws: Workspace, *, wait: bool, tool: tuple[str, ...] = ()) -> dict[str, Any]:
    """The `Steps` fields of the wait after a start: `[job] start_wait` seconds (0 with
    `wait=False`) for `[job] ready` in the job's log, else the trainer's readiness line
    (`trainer.base.stopping.STARTED`), else (a `[job] command`, a trainer tool) its first line."""
    job = ws.config.job
    ready = "" if tool else job.ready or (STARTED if job.command is None else "")
    return {"wait": job.start_wait if wait else 0.0, "ready": ready}


def started(ws: Workspace, done: client.Done, *, release: str, redo: str) -> StartUp | None:
    """The job's start-up as the command saw it; one that ended with a failure raises
    `JobEndedAtStartUp` with its log's last lines (`redo`: the command to run again)."""
    startup = done.startup
    if startup is not None and startup.outcome == "ended":
        code = startup.state.exit_code if startup.state is not None else None
        if code != 0:
            raise ended_at_start_up(ws, startup, release=release, redo=redo)
    return startup


def ended_at_start_up(
    ws: Workspace, startup: StartUp, *, release: str, redo: str
) -> JobEndedAtStartUp:
    state = startup.state
    how = f"exit {state.exit_code}" if state is not None and state.exit_code is not None else ""
    lines = "".join(f"\n  {line}" for line in startup.lines) or "\n  (the log is empty)"
    return JobEndedAtStartUp(
        f"The job of release {release} ended at start-up on {ws.target.describe()}"
        f"{f' ({how})' if how else ''}; the last lines of its log ({ws.log_path}):{lines}",
        hint=f"Fix what it says, then run {redo} again (dflash logs --tail 200 shows more; "
        "dflash rollback starts the release before).",
    )


def launch_argv(ws: Workspace) -> list[str]:
    """What the job's tmux session runs: the current release's `launch.sh`."""
    return ["bash", f"{ws.target.root}/current/launch.sh"]


def remote_plan(
    ws: Workspace, *, warn: Say, env: dict[str, str] | None = None
) -> client.DeployPlan:
    """The target's parts as the site program needs them. Opens the place without the
    container check: the program's command is that check (see `Workspace.open`). `env`: added
    to `[job] env` for this start only."""
    ws.open(check=False)
    return client.DeployPlan(
        preflight=doctor.deploy_preflight(Setup.of(ws), ws.place.description),
        releases=ws.releases(),
        job=ws.job(),
        lock=ws.lock(warn=warn),
        checkpoints=ws.checkpoints(),
        launch=launch_argv(ws),
        cwd=f"{ws.target.root}/current",
        env={**ws.config.job.env, **(env or {})},
    )


def deploy(
    ws: Workspace,
    *,
    resume: bool = False,
    force_resume: bool = False,
    force: bool = False,
    say: Say = _quiet,
    warn: Say | None = None,
    tool: tuple[str, ...] = (),
    wait: bool = True,
) -> DeployReport:
    """Build the bundle here, then do everything at the place in ONE command
    (`remote/site.sh deploy`): preflight (tmux, python), lock, unpack, check, stop, switch,
    prune, archive, start, unlock, ready. A held lock costs `DeployLock.acquire`'s commands and one more run.
    `tool` makes the job run another trainer module than `trainer.commands.train` (`dflash generate`).
    `force_resume`: this start of the trainer resumes even from a checkpoint written with other
    model/data settings (`DFLASH_FORCE_RESUME=1` in its env; later restarts do not).
    `wait`: then wait until the job is past start-up (site.sh's `ready` step)."""
    extra = {FORCE_RESUME_ENV: "1"} if force_resume else None
    remote = remote_plan(ws, warn=warn or say, env=extra)
    plan = LaunchPlan.for_job(
        ws.config.job,
        release_id=new_release_id(),
        python=ws.target.python,
        checkpoints=ws.target.checkpoints,
        tool=tool,
    )
    bundle = build_bundle(
        ws.config.project_dir, plan=plan, train=ws.config.train, target=ws.target.describe()
    )
    say(f"Release {bundle.release_id} ({len(bundle.data) / 1024:.0f} KiB) → {ws.target.describe()}")
    steps = client.Steps(
        doing="deploy",
        bundle=bundle,
        archive=not resume,
        preflight=True,
        **start_wait(ws, wait=wait, tool=tool),
    )
    try:
        done = client.run(remote, steps, force=force, notice=say, progress=say)
    except doctor.VenvNotBuilt:  # built once, then every deploy finds it
        say(f"Building the job's environment at {ws.target.describe()} (dflash setup):")
        environment.build(ws, say=say)
        done = client.run(remote, steps, force=force, notice=say, progress=say)
    assert done.started is not None
    if done.stopped is not None:
        say(f"Stopped the previous job (exit {done.stopped.exit_code}).")
    if done.archived:
        say(f"Archived the previous checkpoints into {done.archived}.")
    state.save(
        ws.config.project_dir,
        state.DeployRecord(
            flags=ws.flags,
            target=ws.target.describe(),
            release=bundle.release_id,
            deployed_at=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        ),
    )
    redo = "dflash generate" if tool else "dflash deploy"
    startup = started(ws, done, release=bundle.release_id, redo=redo)
    return DeployReport(
        release=bundle.release_id,
        removed=done.removed,
        stopped=done.stopped,
        archived=done.archived,
        started=done.started,
        startup=startup,
        interrupted=done.interrupted,
        devices=probed_devices(done.probe),
    )


def restart(
    ws: Workspace,
    *,
    clean: bool = False,
    force: bool = False,
    say: Say = _quiet,
    progress: Say = _quiet,
    wait: bool = True,
) -> RestartReport:
    """stop → archive (with `clean`) → start on `current`: one command at the place; then,
    with `wait`, until the job is past start-up. `say`: warnings (the lock's) and notices;
    `progress`: the place's steps as they go."""
    steps = client.Steps(doing="restart", archive=clean, **start_wait(ws, wait=wait))
    done = client.run(remote_plan(ws, warn=say), steps, force=force, notice=say, progress=progress)
    assert done.release is not None and done.started is not None
    _say_survived(done, say)
    startup = started(ws, done, release=done.release, redo="dflash restart")
    return RestartReport(
        release=done.release,
        stopped=done.stopped,
        archived=done.archived,
        started=done.started,
        startup=startup,
        interrupted=done.interrupted,
        cleaned=done.cleaned,
    )


def rollback(
    ws: Workspace,
    *,
    to: str | None = None,
    force: bool = False,
    say: Say = _quiet,
    progress: Say = _quiet,
    wait: bool = True,
) -> RestartReport:
    """Point `current` at an earlier complete release and restart the job on it (resuming:
    the checkpoints stay where they are). The target is chosen from `current` as read now;
    the one command takes the lock, checks that `current` has not moved since, and does
    stop → switch → start."""
    remote = remote_plan(ws, warn=say)
    current = remote.releases.current()
    target = remote.releases.rollback_target(to)
    steps = client.Steps(doing="rollback", switch_to=target, **start_wait(ws, wait=wait))
    done = client.run(
        remote, steps, force=force, expect=current or "", notice=say, progress=progress
    )
    assert done.started is not None
    _say_survived(done, say)
    startup = started(ws, done, release=target, redo="dflash restart")
    return RestartReport(
        release=target,
        stopped=done.stopped,
        archived=None,
        started=done.started,
        startup=startup,
        interrupted=done.interrupted,
        cleaned=done.cleaned,
    )


def stop(
    ws: Workspace,
    *,
    force: bool = False,
    save: bool = True,
    say: Say = _quiet,
    progress: Say = _quiet,
) -> JobState | None:
    """SIGINT → SIGTERM → SIGKILL, end the session: one command at the place, under the lock.
    `save=False`: SIGTERM right after SIGINT, so the trainer ends without its stop checkpoint."""
    steps = client.Steps(doing="stop", save=save)
    done = client.run(remote_plan(ws, warn=say), steps, force=force, notice=say, progress=progress)
    _say_survived(done, say)
    return done.stopped


def _say_survived(done: client.Done, say: Say) -> None:
    """A stopped job whose process group outlived SIGKILL (a process stuck in the kernel)."""
    if done.survived is not None:
        say(
            f"Processes of the stopped job (process group {done.survived}) are still alive "
            "after SIGKILL: they are stuck in the kernel (a hung disk or GPU driver?); check "
            f"them at the place: ps -o pid,stat,wchan,cmd -g {done.survived}"
        )


def status(ws: Workspace, *, lines: int = 10) -> dict[str, Any]:
    """Everything `dflash status` shows, as one JSON-ready object."""
    job = ws.job()
    current = job.state()
    log = job.tail(lines, cap=STATUS_LOG_CAP)
    started = (
        dt.datetime.fromtimestamp(current.started_at, dt.UTC).isoformat(timespec="seconds")
        if current.started_at is not None
        else None
    )
    metrics = last_metrics(ws)
    return {
        "target": ws.target.name,
        "place": ws.target.describe(),
        "session": current.session,
        "socket": job.socket,
        "deployed_here": ws.deployed_here,
        "exists": current.exists,
        "running": current.running,
        "exit_code": current.exit_code,
        "started_at": started,
        "release": ws.releases().current(),
        "job_release": job_release(ws, current),
        "log": ws.log_path,
        "log_bytes": max(log.size, 0),
        "last_lines": log.body.decode("utf-8", "backslashreplace").splitlines(),
        "log_cut": log.cut,
        "metrics": metrics,
        "split": gpus.split_summary(metrics),
        **gpu_status(ws, metrics),
    }


# The DFLASH_RELEASE that `launch.sh` exported into the job's process ($1, the pane's).
_JOB_RELEASE = 'tr "\\0" "\\n" < "/proc/$1/environ" | sed -n "s/^DFLASH_RELEASE=//p"'


def job_release(ws: Workspace, current: JobState) -> str | None:
    """The release the running job was started from (None when not running or not known):
    it differs from `current` after a switch whose restart did not happen (a dropped deploy,
    a manual change)."""
    if not current.running or current.pid is None:
        return None
    found = ws.place.run(
        ["bash", "-c", _JOB_RELEASE, "dflash-release", str(current.pid)], check=False
    )
    release = found.stdout_text.strip().splitlines()
    return release[0] if found.exit_code == 0 and release else None


def gpu_status(ws: Workspace, metrics: dict[str, Any] | None) -> dict[str, Any]:
    """`gpus`: one row per GPU at the place (None without nvidia-smi), `gpu_note`: why not."""
    env = ws.config.job.env
    readings, note = gpus.read(ws.place, env)
    if readings is None:
        return {"gpus": None, "gpu_note": note}
    host = None
    if len(gpus.hosts_of(metrics)) > 1:  # several nodes: only the ranks of this one are here
        found = ws.place.run(["uname", "-n"], check=False)
        host = found.stdout_text.strip() or None
    return {"gpus": gpus.table(readings, metrics, env=env, host=host), "gpu_note": None}


# The last line of file $1, at most its last $2 bytes (`tail -n 1` alone of a file that ends in a
# huge line would send all of it).
_LAST_ROW = 'tail -n 2 -- "$1" | tail -c "$2"'  # the last two lines: the last may be torn


def last_metrics(ws: Workspace) -> dict[str, Any] | None:
    """The last whole row of `<checkpoints>/metrics.jsonl` (step, loss, tokens_per_s, time, …):
    a torn last line (a write cut short by a kill or a full disk) is passed over, as the
    trainer cuts it when it resumes (`trainer.run.metrics`); what is read is bounded."""
    argv = ["bash", "-c", _LAST_ROW, "dflash-metrics", ws.metrics_path, str(METRICS_CAP)]
    result = ws.place.run(argv, check=False, cap=METRICS_CAP)
    if result.exit_code != 0:
        return None
    for line in reversed(result.stdout.splitlines()):
        try:
            data = json.loads(line.decode("utf-8", "replace"))
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("step"), int):
            return data
    return None
