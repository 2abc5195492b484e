"""The client of the site program (`site.sh`): the one way dflash changes a place.

`dflash deploy`, restart, rollback and stop each run ONE remote command: `bash -c SITE
dflash-<command> <command> --option VALUE … -- TMUX-ARGS…`, with the bundle's tar on stdin for
a deploy. Over SSH every command starts the account's login shell (and `pct exec` enters the
container's namespaces), so one command instead of ten is most of a deploy's time. Every value
travels as an argv element (named options, quoted only by `shell.quote_argv` on the way); the
program's text is fixed, read from `site.sh` beside this module.

The answer is read from the step lines the program prints (`Outcome.of`), and a failure becomes
the typed error of the step that failed through one table (`_ERRORS`). While it runs, its lines
are read as they come (`progress.Progress`): the long steps are said as they begin and while they
last, and a connection dropped on the way is said with the step the program had reached. A held lock (exit 3) is
judged here (`DeployLock.judge`: wait, take over a stale record, or `--force`) and the command
runs once more. A command killed on its way (no `failed` line) makes the client look at the
place again, so a container stopped under it is reported as such.

Each step has a bound (`step_bound`: the place's `timeout`; the trainer's check and the stop
get what they need on top), judged here as the step lines arrive (`StepWatch`): a step that
overruns ends the command (the program's watcher then ends everything it started at the place)
and raises `CommandTimedOut` naming the step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dflash_ops.connect.stdin import HeldOpen
from dflash_ops.connect.transport import Result
from dflash_ops.errors import (
    CommandTimedOut,
    ConnectionDropped,
    DflashError,
    Interrupted,
    ReleaseError,
    RemoteCommandFailed,
)
from dflash_ops.remote import interrupt
from dflash_ops.remote.checkpoints import Checkpoints, PruneReport
from dflash_ops.remote.job import Job, JobState, StartUp
from dflash_ops.remote.lock import DeployLock, Owner
from dflash_ops.remote.progress import START_UP, Progress, Say, StepWatch
from dflash_ops.remote.release import KEEP, Bundle, Releases, checked_id
from dflash_ops.untrusted import last_line

log = logging.getLogger(__name__)

SITE = (Path(__file__).parent / "site.sh").read_text()
Command = Literal["deploy", "restart", "rollback", "stop"]  # site.sh's changing commands
HELD = 3  # site.sh: the lock is held by someone else
MOVED = 4  # site.sh: rollback found `current` moved since it chose its target
PREFLIGHT = 10  # site.sh: tmux or python failed the preflight
ANSWER_CAP = 1024 * 1024  # bytes of the program's answer kept (its step lines are short)


def site_argv(
    command: str, options: Sequence[tuple[str, str]], tail: Sequence[str] = ()
) -> list[str]:
    """`bash -c SITE dflash-<command> <command> --name value … [-- tail…]`."""
    argv = ["bash", "-c", SITE, f"dflash-{command}", command]
    for name, value in options:
        argv += [f"--{name}", value]
    return [*argv, "--", *tail] if tail else argv


@dataclass(kw_only=True)
class Outcome:
    """What one run of the program printed: the steps reached and what they found."""

    exit_code: int
    stderr: str
    steps: list[str] = field(default_factory=list)
    facts: dict[str, list[str]] = field(default_factory=dict)
    held: str | None = None

    @classmethod
    def of(cls, result: Result) -> Outcome:
        outcome = cls(exit_code=result.exit_code, stderr=result.stderr_text)
        text = result.stdout_text
        head, sep, rest = text.partition("\nheld\t")  # the holder's record: all that follows
        if sep:
            outcome.held, text = rest.removesuffix("\n"), head
        for line in text.splitlines():
            key, _, value = line.partition("\t")
            if key == "step":
                outcome.steps.append(value)
            else:
                outcome.facts.setdefault(key, []).append(value)
        return outcome

    def fact(self, key: str) -> str | None:
        values = self.facts.get(key)
        return values[-1] if values else None

    @property
    def step(self) -> str:
        return self.steps[-1] if self.steps else START_UP

    @property
    def code(self) -> int:
        """The failed step's own status (`failed<TAB>STATUS`), else the command's exit."""
        status = self.fact("failed")
        return int(status) if status and status.isdigit() else self.exit_code


@dataclass(frozen=True, kw_only=True)
class Steps:
    """One command of the program: deploy (`bundle`), rollback (`switch_to`), restart, stop."""

    doing: Command  # the program's command, and the lock's `doing`
    bundle: Bundle | None = None  # deploy: unpack it, switch to it, prune
    switch_to: str | None = None  # rollback: switch to this complete release
    archive: bool = False  # archive the checkpoints after the stop (deploy, restart)
    preflight: bool = False  # deploy: tmux and python first, the bundle's train.toml checked
    save: bool = True  # the stop gives the job `stop_timeout` to save (False: SIGTERM at once)
    wait: float = 0.0  # after the start: seconds to wait for the job to be past start-up
    ready: str = ""  # the log line that says so ("": any line)

    @property
    def release(self) -> str | None:
        """The release `current` is switched to: the bundle's, the rollback's, or None."""
        return self.bundle.release_id if self.bundle is not None else self.switch_to


@dataclass(frozen=True, kw_only=True)
class Done:
    release: str | None  # the release `current` points at (None for a stop)
    removed: list[str]
    stopped: JobState | None
    archived: str | None
    started: JobState | None
    logged: int = 0  # the log's size before the start: the new job's output begins there
    startup: StartUp | None = None  # how its start-up went (None: not waited for)
    interrupted: bool = False  # an interrupt came after the stop began: the command went on
    cleaned: list[str] = field(default_factory=list)  # unfinished `<id>.tmp` releases removed
    survived: int | None = None  # the stopped job's process group, alive after SIGKILL
    probe: str | None = None  # a deploy's python probe: "STATUS {json}"


@dataclass(frozen=True, kw_only=True)
class Preflight:
    """A deploy's checks before anything changes, as the caller words them: the job's python
    answering a probe (after `tmux -V`), the trainer's check of the bundle's train.toml (empty:
    none), and the typed errors of their failures (`dflash doctor`'s own words)."""

    probe: Sequence[str]
    check: Sequence[str]
    failed: Callable[[str, Result], DflashError]  # "tmux" or "python", and what it answered
    invalid: Callable[[int, Sequence[str]], DflashError]  # the check's status and its lines
    check_seconds: float = 0.0  # the check's own bound (the place's timeout when larger)


@dataclass(frozen=True, kw_only=True)
class DeployPlan:
    """Everything the program needs besides the steps: the target's parts and the job;
    `preflight`: what a deploy checks first (None: nothing)."""

    releases: Releases
    job: Job
    lock: DeployLock
    checkpoints: Checkpoints
    launch: Sequence[str]  # the job's argv
    cwd: str
    env: dict[str, str]
    preflight: Preflight | None = None
    keep: int = KEEP


def argv(
    plan: DeployPlan, steps: Steps, owner: Owner, *, stale: str, archive: str, expect: str = ""
) -> list[str]:
    """The one command. `stale`: a lock record judged stale (or forced), taken over at the
    place if the lock still holds it; `expect`: the release `current` must still point at
    (rollback chose its target from it)."""
    options = [
        ("root", plan.releases.root),
        ("lock", plan.lock.path),
        ("owner", owner.text()),
        ("checkpoints", plan.checkpoints.path),
        ("socket", plan.job.socket),
        ("session", plan.job.session),
        ("log", plan.job.log),
        ("stop-ticks", ",".join(plan.job.stop_ticks(save=steps.save))),
        ("tool-timeout", f"{plan.releases.place.timeout:g}"),
    ]
    options += [("stale", stale)] if stale else []
    options += [("archive-to", archive)] if archive else []
    if steps.release:
        options.append(("release", checked_id(steps.release)))
    if expect:
        options.append(("expect", checked_id(expect)))
    if steps.bundle is not None:
        options += [("bundle-size", str(len(steps.bundle.data))), ("keep", str(plan.keep))]
        options += _preflight(plan, steps)
    if steps.doing != "stop" and steps.wait > 0:
        options += [("wait", str(max(1, round(steps.wait * 10)))), ("ready", steps.ready)]
    tail = plan.job.start_args(plan.launch, cwd=plan.cwd, env=plan.env)
    return site_argv(steps.doing, options, [] if steps.doing == "stop" else tail)


def _preflight(plan: DeployPlan, steps: Steps) -> list[tuple[str, str]]:
    """`--probe` (the job's python) and `--check` (the trainer's check of train.toml) words."""
    if not steps.preflight or plan.preflight is None:
        return []
    words = [("probe", word) for word in plan.preflight.probe]
    return words + [("check", word) for word in plan.preflight.check]


def run(
    plan: DeployPlan,
    steps: Steps,
    *,
    force: bool = False,
    expect: str = "",
    notice: Callable[[str], None] | None = None,
    progress: Say | None = None,
) -> Done:
    """Run `steps` at the place: one command when the lock is free. A held lock is judged
    here (`DeployLock.judge`, with the place's word on whether the holding program lives): the
    command runs again after a short wait, or taking over the stale record, until the lock's
    wait is over (`LockHeld`). The program holds the lock itself and releases it on exit.
    `progress` gets the place's steps as they go (`progress.Progress`).

    Ctrl-C meanwhile (`interrupt`): `notice` is told at once; before the stop the command ends
    with nothing changed (`Interrupted`), from the stop on it goes on to the end (`Done` with
    `interrupted`); a second Ctrl-C leaves without its answer (`Interrupted`)."""
    say = notice or _quiet
    with interrupt.deferred(lambda: say(_notice(steps.doing))) as caught:
        try:
            outcome = _until_free(
                plan, steps, caught, force=force, expect=expect, progress=progress or _quiet
            )
        except KeyboardInterrupt:
            raise _left(plan, steps) from None
    if caught.asked and "stop" not in outcome.steps:
        raise _interrupted_before(plan, steps)
    if outcome.exit_code != 0 or outcome.step != "done":
        raise error(plan, steps, outcome)
    stopped, started = outcome.fact("stopped"), outcome.fact("started")
    survived = outcome.fact("survived") or ""
    return Done(
        release=steps.release or outcome.fact("current"),
        removed=sorted(outcome.facts.get("removed", [])),
        stopped=plan.job.parse_line(stopped) if stopped else None,
        archived=outcome.fact("archived"),
        started=plan.job.parse_line(started) if started else None,
        logged=int(outcome.fact("logged") or 0),
        startup=_startup(plan.job, outcome),
        interrupted=caught.asked,
        cleaned=sorted(outcome.facts.get("cleaned", [])),
        survived=int(survived) if survived.isdigit() else None,
        probe=outcome.fact("python"),
    )


def _until_free(
    plan: DeployPlan,
    steps: Steps,
    caught: interrupt.Interrupt,
    *,
    force: bool,
    expect: str,
    progress: Say,
) -> Outcome:
    """The command's outcome once the lock was not held (or the wait for it is over, or an
    interrupt came)."""
    archive = plan.checkpoints.archive_dest() if steps.archive else ""
    owner = Owner.me(steps.doing)
    deadline = time.monotonic() + plan.lock.wait
    stale = ""
    while True:
        if caught.asked:
            raise _interrupted_before(plan, steps)
        held = caught.hold(HeldOpen(steps.bundle.data if steps.bundle else b""))
        outcome = _run(
            plan, steps, owner, held, stale=stale, archive=archive, expect=expect, progress=progress
        )
        if outcome.exit_code != HELD or outcome.held is None or caught.asked:
            return outcome
        judged = plan.lock.judge(
            outcome.held, force=force, deadline=deadline, holder=outcome.fact("holder")
        )
        stale = judged or ""


def _quiet(_: str) -> None:
    pass


def _notice(doing: str) -> str:
    goes_on = "stop" if doing == "stop" else f"{doing}, up to the start of the job"
    return (
        f"Interrupted: finishing safely. Before the running job is stopped nothing changes; once "
        f"it is stopping, the {goes_on}, goes on. Ctrl-C again to leave without waiting."
    )


def _interrupted_before(plan: DeployPlan, steps: Steps) -> Interrupted:
    where = plan.releases.place.description
    return Interrupted(
        f"Interrupted before the running job was stopped: the {steps.doing} changed nothing "
        f"at {where}.",
        hint=f"Run dflash {steps.doing} again when you want it.",
    )


def _left(plan: DeployPlan, steps: Steps) -> Interrupted:
    where = plan.releases.place.description
    return Interrupted(
        f"Interrupted twice: left without waiting for {where}. Its {steps.doing} either changed "
        "nothing or, if the running job was already stopping, goes on to the end there.",
        hint="dflash status shows which release runs.",
    )


def _startup(job: Job, outcome: Outcome) -> StartUp | None:
    """What the `ready` step said: the job's readiness, or its end and last log lines."""
    ended = outcome.fact("ended")
    if ended is not None:
        lines = tuple(outcome.facts.get("tail", []))  # shown rendered (`cli/output.py`)
        state = job.parse_line(ended) if ended else None
        return StartUp(outcome="ended", state=state, lines=lines)
    said = outcome.fact("startup")
    for known in ("ready", "starting", "interrupted"):
        if said == known:
            return StartUp(outcome=known)
    return None


def _run(
    plan: DeployPlan,
    steps: Steps,
    owner: Owner,
    held: HeldOpen,
    *,
    stale: str,
    archive: str,
    expect: str,
    progress: Say,
) -> Outcome:
    # stdin: the bundle (if any), then held open until the program exits: its end tells the
    # program that this command is gone or let go of it (`watch_caller`, `hold_on`).
    place = plan.releases.place
    said = Progress(steps.doing, progress)
    watch = StepWatch(lambda step: step_bound(plan, steps, step), said)
    try:
        result = place.run(
            argv(plan, steps, owner, stale=stale, archive=archive, expect=expect),
            stdin=held,
            check=False,
            cap=ANSWER_CAP,
            watch=watch,
        )
    except CommandTimedOut:
        raise watch.overrun(steps.doing, place.description, place.timeout) from None
    except ConnectionDropped as exc:
        raise said.dropped(place.description, exc) from None
    outcome = Outcome.of(result)
    log.debug("%s steps %s, exit %s", steps.doing, outcome.steps, outcome.exit_code)
    return outcome


# --- how long each step may take --------------------------------------------------------------


def step_bound(plan: DeployPlan, steps: Steps, step: str) -> float:
    """Seconds step `step` of the program may take: the place's `timeout`; the stop also the
    job's stop waits (`Job.stop_seconds`), the trainer's check at least its own bound, the wait
    for the job's start-up its own length on top."""
    bound = plan.releases.place.timeout
    if step == "stop":
        return bound + plan.job.stop_seconds()
    if step == "check" and plan.preflight is not None:
        return max(bound, plan.preflight.check_seconds)
    if step == "ready":
        return bound + steps.wait
    return bound


# --- the one table from a failed step to its typed error -------------------------------------

Failure = Callable[["DeployPlan", Steps, Outcome], DflashError | None]


def _preflight_failed(plan: DeployPlan, steps: Steps, outcome: Outcome) -> DflashError | None:
    """tmux or python, in the caller's words (`Preflight.failed`)."""
    if outcome.exit_code != PREFLIGHT or plan.preflight is None:
        return None
    step = outcome.step
    said, _, out = (outcome.fact(step) or "").partition(" ")
    result = Result((step,), int(said) if said.isdigit() else outcome.exit_code,
                    out.encode(), outcome.stderr.encode())  # fmt: skip
    return plan.preflight.failed(step, result)


def _check_failed(plan: DeployPlan, steps: Steps, outcome: Outcome) -> DflashError | None:
    if plan.preflight is None:
        return None
    return plan.preflight.invalid(outcome.code, outcome.facts.get("check", []))


def _unpack_failed(plan: DeployPlan, steps: Steps, outcome: Outcome) -> DflashError | None:
    if steps.release is None:
        return None
    return plan.releases.unpack_failed(steps.release, outcome.stderr)


def _switch_failed(plan: DeployPlan, steps: Steps, outcome: Outcome) -> DflashError | None:
    if steps.release is None:
        return None
    if outcome.code == MOVED:
        return _moved(plan, steps.release, outcome.fact("moved") or "?")
    return plan.releases.switch_failed(steps.release, outcome.stderr)


def _moved(plan: DeployPlan, release: str, now: str) -> ReleaseError:
    """Rollback lost a race: another command switched `current` after it chose its target."""
    return ReleaseError(
        f"Did not roll back to {release}: {plan.releases.current_path} was switched to {now} "
        "by another command after rollback chose its target; nothing was changed.",
        hint="Run dflash rollback again: it chooses from where current is now (dflash "
        "releases lists them).",
    )


def _no_current(plan: DeployPlan, steps: Steps, outcome: Outcome) -> DflashError:
    return plan.releases.nothing_deployed()


def _start_failed(plan: DeployPlan, steps: Steps, outcome: Outcome) -> DflashError:
    return plan.job.start_failed(outcome.code, outcome.stderr)


def _stop_failed(plan: DeployPlan, steps: Steps, outcome: Outcome) -> DflashError | None:
    return plan.job.stop_failed(outcome.code, outcome.stderr)


_ERRORS: dict[str, Failure] = {
    "tmux": _preflight_failed,
    "python": _preflight_failed,
    "check": _check_failed,
    "unpack": _unpack_failed,
    "switch": _switch_failed,
    "expect": _switch_failed,
    "current": _no_current,
    "stop": _stop_failed,
    "start": _start_failed,
}


def error(plan: DeployPlan, steps: Steps, outcome: Outcome) -> DflashError:
    """The typed error of the step that failed (`_ERRORS`), else `RemoteCommandFailed`."""
    if outcome.exit_code != PREFLIGHT and outcome.fact("failed") is None:
        # Killed on its way (a container stopped under it): looking at the place again
        # raises the place's own error when the place is what went away.
        plan.job.state()
    mapped = _ERRORS.get(outcome.step)
    found = mapped(plan, steps, outcome) if mapped is not None else None
    if found is not None:
        return found
    where = plan.releases.place.description
    return RemoteCommandFailed(
        where, (f"dflash-{steps.doing}", outcome.step), outcome.code, outcome.stderr
    )


# --- checkpoints prune: one command per archived run ---------------------------------------

REFUSED = 3  # site.sh prune-run: the entry failed its proof at the place


def delete_runs(checkpoints: Checkpoints, stamps: Sequence[str]) -> PruneReport:
    """Delete the archived runs `stamps` (chosen by `checkpoints.choose`), each by `site.sh
    prune-run`, which proves at the place that the entry is a run before `rm`."""
    deleted, refused = [], []
    place = checkpoints.place
    for stamp in stamps:
        options = [("checkpoints", checkpoints.path), ("run", checkpoints.run_path(stamp))]
        result = place.run(site_argv("prune-run", options), check=False)
        if result.exit_code == 0:
            deleted.append(stamp)
        elif result.exit_code == REFUSED:
            refused.append(last_line(result.stderr_text))
        else:
            raise RemoteCommandFailed(
                place.description, result.argv, result.exit_code, result.stderr_text
            )
    return PruneReport(deleted=deleted, refused=refused)
