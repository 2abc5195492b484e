"""The remote work of `dflash deploy` (and of restart, rollback and stop) as ONE command.

Over SSH every command starts the account's login shell (and `pct exec` enters the
container's namespaces): a deploy of ten separate commands paid that ten times. Here the whole
deploy is one `bash -c SCRIPT dflash-deploy ARGS…` fed the bundle's tar on stdin. SCRIPT is
fixed text: the bash functions of the layers that own each step (`lock.FUNCTIONS`,
`release.FUNCTIONS`, `checkpoints.FUNCTIONS`, `job.FUNCTIONS` — the same text those modules
run on their own) and `_MAIN`, which calls them in order. Every value (paths, the owner
record, the probe's and tmux's argv, the job's environment) is a positional argument, quoted
only by `shell.quote_argv` on the way; the tmux arguments that start the job are built by
`Job.start_args`, the stop's by `Job.stop_args`.

The steps, in order, each announced on stdout as `step<TAB>NAME` before it runs (`Steps`
says which of them a command does):

1. `tmux`, `python` (deploy) — `tmux -V` and the job's python answering
   `checks.VERSION_PROBE` with the job's env, judged by `checks.judge_tmux`/`judge_python`:
   doctor's own words. A failure exits before anything is touched.
2. `lock` — `dflash_lock_take` with a record naming this script at the place (pid, boot id,
   start time: `lock.py`), after taking over the record the caller judged stale, if the lock
   still holds it. A held lock ends the command with exit 3, `holder<TAB>alive|gone|unknown`
   (the place's word on the holding script) and `held<TAB>RECORD` as its last line; the caller
   judges it (`DeployLock.judge`: wait, take over a stale one, or `--force`) and runs the
   command once more. From here an EXIT trap releases the lock (only if it is still ours).
3. `unpack`, `check`, `switch`, `prune` (deploy; rollback: `switch` only, and only while
   `current` is still the release the rollback target was chosen from) — `releases/<id>.tmp` →
   the trainer's own check of its `train.toml` (`train_check`; a failure removes the `.tmp` and
   exits 1 with the check's lines as `check<TAB>LINE`: nothing else has changed) → marker →
   rename → `current` → keep the last KEEP. Restart instead reads `current`.
4. `stop` — the running job: SIGINT, SIGTERM, SIGKILL, end the session.
5. `archive` — the checkpoints into `archive/<time>` (deploy without `--resume`, restart
   `--clean`).
6. `start` — the job's tmux session running `current/launch.sh` with `[job] env`.
7. `done`.

The steps run in their own process group, and the script never outlives the command that
started it: stdin carries the bundle (exactly its size) and then stays open until the script
exits (`transport.HeldOpen`); once the bundle is read a watcher waits for its end, which comes
early only when the caller was killed or its connection dropped, and then ends the group (the
lock is released on the way out). Every step that ends a tmux session ends the one it read
(`job.dflash_job_end`), never a later one of the same name.

What a step found is printed as `KEY<TAB>VALUE` lines (`removed`, `current`, `stopped`,
`archived`, `started`); a failed step prints `failed<TAB>STATUS` and exits 1, and the caller
raises the error that step raises on its own (`ReleaseError` for unpack/switch, `JobRunning` or
tmux's message for start, …). A command killed on its way (no `failed` line) makes the caller
look at the place again, so a container stopped under it is reported as such.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from dflash_ops import checkpoints, doctor, job, lock, release, train_check
from dflash_ops.checks import Findings, Setup, judge_python, judge_tmux, python_probe_argv
from dflash_ops.errors import DflashError, RemoteCommandFailed
from dflash_ops.job import Job, JobState
from dflash_ops.lock import HELD, DeployLock, Owner
from dflash_ops.release import Bundle, Releases
from dflash_ops.transport import HeldOpen, Result

log = logging.getLogger(__name__)

_PREFLIGHT = 10  # exit status when tmux or python failed

_MAIN = r"""
say() { printf '%s\t%s\n' "$1" "$2"; }
fail() { say failed "$1"; exit 1; }
dflash_watch() {  # $1 our process group: ended once stdin (the caller's line) closes
  # Started once the bundle is read: what is left on stdin is nothing, held open by the
  # caller until we exit. EOF before that means the caller or its connection is gone, and
  # nothing may be done in its name any more: TERM to our group (the EXIT trap releases the
  # lock), then, once the steps' shell is gone (3 s at most), KILL to what is left of it.
  { local n=0
    cat >/dev/null; trap '' TERM; kill -s TERM -- "-$1"
    while kill -0 "$1" 2>/dev/null && [ "$n" -lt 30 ]; do sleep 0.1; n=$((n + 1)); done
    kill -s KILL -- "-$1"
  } 0<&0 >/dev/null 2>&1 &
}
dflash_main() {
root=$1 id=$2 unpack=$3 keep=$4 lock=$5 owner=$6 stale=$7 ckpt=$8 dest=$9 check=${10} run=${11}
size=${12} watch=${13} expect=${14}
shift 14
probe=("${@:2:$1}"); shift $(($1 + 1))
checker=("${@:2:$1}"); shift $(($1 + 1))
stop=("${@:1:5}"); shift 5
# "$@" is now dflash_job_start's arguments.
me=$BASHPID
trap 'exit 143' TERM HUP INT
trap 'trap "" TERM; kill -s TERM -- "-$me"' EXIT  # nothing we started outlives us
if [ "$watch" = 1 ] && [ "$unpack" != 1 ]; then dflash_watch "$me"; fi

if [ "$check" = 1 ]; then
  say step tmux
  if dflash_have_tmux; then out=$(tmux -V); rc=$?; else out="" rc=127; fi
  say tmux "$rc ${out%%$'\n'*}"
  [ "$rc" = 0 ] || exit @PREFLIGHT@
  say step python
  out=$("${probe[@]}" </dev/null); rc=$?
  say python "$rc ${out##*$'\n'}"
  [ "$rc" = 0 ] || exit @PREFLIGHT@
fi

say step lock
record=$(dflash_lock_record "$owner" "$me") || fail 1
if [ -n "$stale" ]; then dflash_lock_take_over "$lock" "$stale" "$me"; fi
held=$(dflash_lock_take "$root" "$lock" "$record"); rc=$?
if [ "$rc" = @HELD@ ]; then
  say holder "$(dflash_lock_holder "$held")"
  say held "$held"
  exit @HELD@
fi
[ "$rc" = 0 ] || fail "$rc"
trap 'dflash_lock_release "$lock" "$record"; trap "" TERM; kill -s TERM -- "-$me"' EXIT

if [ -n "$id" ]; then
  if [ "$unpack" = 1 ]; then
    say step unpack
    head -c "$size" | dflash_unpack "$root" "$id" || fail $?
    if [ "$watch" = 1 ]; then dflash_watch "$me"; fi
    if [ "${#checker[@]}" -gt 0 ] && [ -f "$root/releases/$id.tmp/trainer/check.py" ]; then
      say step check
      out=$(cd -- "$root/releases/$id.tmp" && "${checker[@]}" </dev/null 2>&1); rc=$?
      if [ "$rc" != 0 ]; then
        rm -rf -- "$root/releases/$id.tmp"
        while IFS= read -r l; do say check "$l"; done <<< "$out"
        fail "$rc"
      fi
    fi
  fi
  say step switch
  if [ -n "$expect" ] && [ "$(readlink -- "$root/current")" != "releases/$expect" ]; then
    echo "current is no longer $expect (another command switched it); run again" >&2
    fail 1
  fi
  names=$(dflash_switch "$root" "$id") || fail $?
  if [ "$unpack" = 1 ]; then
    say step prune
    mapfile -t names <<< "$names"
    removed=$(dflash_prune "$root" "$keep" "$id" "${names[@]}") || fail $?
    while IFS= read -r r; do [ -z "$r" ] || say removed "$r"; done <<< "$removed"
  fi
elif [ "$run" = 1 ]; then
  say step current
  current=$(readlink -- "$root/current") || fail $?
  say current "${current##*/}"
fi

say step stop
line=$(dflash_job_stop "${stop[@]}") || fail $?
[ -z "$line" ] || say stopped "$line"

if [ -n "$dest" ]; then
  say step archive
  out=$(dflash_archive "$ckpt" "$dest") || fail $?
  [ "$out" != moved ] || say archived "$dest"
fi

if [ "$run" = 1 ]; then
  say step start
  line=$(dflash_job_start "$@") || fail $?
  say started "$line"
fi
say step 'done'
}
# The steps run as a job of their own (job control: their own process group), which
# `dflash_watch` can end whole; this shell only waits for it and passes its status on. Job
# control goes off once the group exists, so bash prints no "[1]+ Exit N" notice on stderr.
set -m
dflash_main "$@" &
main=$!
set +m
wait "$main"
"""

SCRIPT = (
    lock.FUNCTIONS
    + release.FUNCTIONS
    + checkpoints.FUNCTIONS
    + job.FUNCTIONS
    + _MAIN.replace("@PREFLIGHT@", str(_PREFLIGHT)).replace("@HELD@", str(HELD))
)


@dataclass(kw_only=True)
class Outcome:
    """What one run of the script printed: the steps reached and what they found."""

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
        return self.steps[-1] if self.steps else "start-up"


@dataclass(frozen=True, kw_only=True)
class Steps:
    """Which steps a run does: deploy (`bundle`), rollback (`switch_to`), restart, stop."""

    doing: str  # the lock's `doing`: "deploy", "restart", "rollback", "stop"
    bundle: Bundle | None = None  # unpack it, switch to it, prune
    switch_to: str | None = None  # switch to this complete release (no unpack, no prune)
    archive: bool = False  # archive the checkpoints after the stop
    preflight: bool = False  # tmux and python first; a bundle's train.toml before the switch
    start: bool = True  # start the job (of `current`) at the end
    save: bool = True  # the stop gives the job `stop_timeout` to save (False: SIGTERM at once)

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


@dataclass(frozen=True, kw_only=True)
class DeployPlan:
    """Everything the script needs besides the steps: the target's parts and the job."""

    setup: Setup
    releases: Releases
    job: Job
    lock: DeployLock
    checkpoints: checkpoints.Checkpoints
    launch: Sequence[str]  # the job's argv
    cwd: str
    env: dict[str, str]
    keep: int = release.KEEP


def argv(
    plan: DeployPlan, steps: Steps, owner: Owner, *, stale: str, archive: str, expect: str = ""
) -> list[str]:
    """The one command: `bash -c SCRIPT dflash-<doing> ARGS…`. `stale`: a lock record judged
    stale (or forced), taken over at the place if the lock still holds it; `expect`: the
    release `current` must still point at (rollback chose its target from it)."""
    probe = python_probe_argv(plan.setup)
    checks = steps.preflight and steps.bundle is not None and train_check.applies(plan.setup)
    checker = train_check.check_argv(plan.setup) if checks else []
    size = str(len(steps.bundle.data)) if steps.bundle is not None else ""
    return [
        "bash", "-c", SCRIPT, "dflash-" + steps.doing,
        plan.releases.root, release.checked_id(steps.release) if steps.release else "",
        _flag(steps.bundle is not None), str(plan.keep),
        plan.lock.path, owner.text(), stale, plan.checkpoints.path, archive,
        _flag(steps.preflight), _flag(steps.start), size, "1",
        release.checked_id(expect) if expect else "",
        str(len(probe)), *probe,
        str(len(checker)), *checker,
        *plan.job.stop_args(save=steps.save),
        *plan.job.start_args(plan.launch, cwd=plan.cwd, env=plan.env),
    ]  # fmt: skip


def _flag(value: bool) -> str:
    return "1" if value else "0"


def run(plan: DeployPlan, steps: Steps, *, force: bool = False, expect: str = "") -> Done:
    """Run `steps` at the place: one command when the lock is free. A held lock is judged
    here (`DeployLock.judge`, with the place's word on whether the holding script lives): the
    command runs again after a short wait, or taking over the stale record, until the lock's
    wait is over (`LockHeld`). The script holds the lock itself and releases it on exit."""
    archive = plan.checkpoints.archive_dest() if steps.archive else ""
    owner = Owner.me(steps.doing)
    deadline = time.monotonic() + plan.lock.wait
    stale = ""
    while True:
        outcome = _run(plan, steps, owner, stale=stale, archive=archive, expect=expect)
        if outcome.exit_code != HELD or outcome.held is None:
            break
        judged = plan.lock.judge(
            outcome.held, force=force, deadline=deadline, holder=outcome.fact("holder")
        )
        stale = judged or ""
    if outcome.exit_code != 0 or outcome.step != "done":
        raise _error(plan, steps, outcome)
    stopped, started = outcome.fact("stopped"), outcome.fact("started")
    return Done(
        release=steps.release or outcome.fact("current"),
        removed=sorted(outcome.facts.get("removed", [])),
        stopped=plan.job.parse_line(stopped) if stopped else None,
        archived=outcome.fact("archived"),
        started=plan.job.parse_line(started) if started else None,
    )


def _run(
    plan: DeployPlan, steps: Steps, owner: Owner, *, stale: str, archive: str, expect: str
) -> Outcome:
    # stdin: the bundle (if any), then held open until the script exits: its end tells the
    # script that this command is gone (`dflash_watch`).
    result = plan.releases.place.run(
        argv(plan, steps, owner, stale=stale, archive=archive, expect=expect),
        stdin=HeldOpen(steps.bundle.data if steps.bundle is not None else b""),
        check=False,
        timeout=plan.job.stop_seconds() + 600.0,
    )
    outcome = Outcome.of(result)
    log.debug("%s steps %s, exit %s", steps.doing, outcome.steps, outcome.exit_code)
    return outcome


def _error(plan: DeployPlan, steps: Steps, outcome: Outcome) -> DflashError:
    """The typed error of the step that failed, as that step raises it on its own."""
    step, stderr = outcome.step, outcome.stderr
    where = plan.releases.place.description
    if step in ("tmux", "python") and outcome.exit_code == _PREFLIGHT:
        said, _, out = (outcome.fact(step) or "").partition(" ")
        result = Result((step,), int(said) if said.isdigit() else outcome.exit_code,
                        out.encode(), stderr.encode())  # fmt: skip
        if step == "tmux":
            check = judge_tmux(plan.setup, where, result)
        else:
            check = judge_python(plan.setup, where, result, Findings())
        return doctor.failure(check)
    status = outcome.fact("failed")
    if status is None:
        # Killed on its way (a container stopped under it): looking at the place again
        # raises the place's own error when the place is what went away.
        plan.job.state()
    code = int(status) if status and status.isdigit() else outcome.exit_code
    if step == "check":
        return train_check.invalid(where, code, outcome.facts.get("check", []))
    if step == "unpack" and steps.bundle is not None:
        return plan.releases.unpack_failed(steps.bundle.release_id, stderr)
    if step == "switch" and steps.release is not None:
        return plan.releases.switch_failed(steps.release, stderr)
    if step == "current":
        return plan.releases.nothing_deployed()
    if step == "start":
        try:
            plan.job.check_started(code, "", stderr)
        except DflashError as exc:
            return exc
    return RemoteCommandFailed(where, (f"dflash-{steps.doing}", step), code, stderr)
