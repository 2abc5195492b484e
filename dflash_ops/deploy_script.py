"""`dflash deploy`'s remote work as ONE command at the place.

Over SSH every command starts the account's login shell (and `pct exec` enters the
container's namespaces): a deploy of ten separate commands paid that ten times. Here the whole
deploy is one `bash -c SCRIPT dflash-deploy ARGS…` fed the bundle's tar on stdin. SCRIPT is
fixed text: the bash functions of the layers that own each step (`lock.FUNCTIONS`,
`release.FUNCTIONS`, `job.FUNCTIONS`, `checkpoints.FUNCTIONS` — the same text those modules
run on their own) and `_MAIN`, which calls them in order. Every value (paths, the owner
record, the probe's and tmux's argv, the job's environment) is a positional argument, quoted
only by `shell.quote_argv` on the way.

The steps, in order, each announced on stdout as `step<TAB>NAME` before it runs:

1. `tmux`, `python` — preflight: `tmux -V` and the job's python answering `checks.VERSION_PROBE`
   (with the job's env), judged by `checks.judge_tmux`/`judge_python`, doctor's own words.
2. `lock` — `dflash_lock_take` (or, on a second run, check that the lock is ours). A held lock
   ends the command with exit 3 and `held<TAB>RECORD`; the caller then waits, takes over a
   stale lock or forces it with `DeployLock.acquire` and runs the command once more in
   `held` mode. From here an EXIT trap releases the lock (only if it is still ours).
3. `unpack`, `switch`, `prune` — the release (`releases/<id>.tmp` → marker → rename →
   `current` → keep the last KEEP).
4. `stop` — the running job: SIGINT, SIGTERM, SIGKILL, end the session.
5. `archive` — the checkpoints into `archive/<time>` (skipped with `--resume`).
6. `start` — the job's tmux session running `current/launch.sh` with `[job] env`.

What a step found is printed as `KEY<TAB>VALUE` lines (`removed`, `stopped`, `archived`,
`started`); a failed step prints `failed<TAB>STATUS` and the command exits 1, so the caller
raises the same typed error the step raises on its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dflash_ops import checkpoints, doctor, job, lock, release
from dflash_ops.checks import Findings, Setup, judge_python, judge_tmux, python_probe_argv
from dflash_ops.errors import DflashError, RemoteCommandFailed
from dflash_ops.job import Job, JobState
from dflash_ops.lock import HELD, DeployLock, Owner
from dflash_ops.release import Bundle, Releases
from dflash_ops.transport import Result

log = logging.getLogger(__name__)

_PREFLIGHT = 10  # exit status when tmux or python failed

_MAIN = r"""
say() { printf '%s\t%s\n' "$1" "$2"; }
fail() { say failed "$1"; exit 1; }
root=$1 id=$2 keep=$3 lock=$4 owner=$5 mode=$6 ckpt=$7 dest=$8
shift 8
probe=("${@:2:$1}"); shift $(($1 + 1))
stop=("${@:1:5}"); shift 5
# "$@" is now dflash_job_start's arguments.

say step tmux
if command -v tmux >/dev/null; then
  out=$(tmux -V); rc=$?
else
  echo "tmux: command not found" >&2; out="" rc=127
fi
say tmux "$rc ${out%%$'\n'*}"
[ "$rc" = 0 ] || exit @PREFLIGHT@
say step python
out=$("${probe[@]}"); rc=$?
say python "$rc ${out##*$'\n'}"
[ "$rc" = 0 ] || exit @PREFLIGHT@

say step lock
if [ "$mode" = held ]; then
  dflash_lock_is_mine "$lock" "$owner" || { echo "the deploy lock $lock is not ours" >&2; fail 1; }
else
  held=$(dflash_lock_take "$root" "$lock" "$owner"); rc=$?
  if [ "$rc" = @HELD@ ]; then say held "$held"; exit @HELD@; fi
  [ "$rc" = 0 ] || fail "$rc"
fi
trap 'dflash_lock_release "$lock" "$owner"' EXIT

say step unpack
dflash_unpack "$root" "$id" || fail $?
say step switch
names=$(dflash_switch "$root" "$id") || fail $?
say step prune
mapfile -t names <<< "$names"
removed=$(dflash_prune "$root" "$keep" "$id" "${names[@]}") || fail $?
while IFS= read -r r; do [ -z "$r" ] || say removed "$r"; done <<< "$removed"

say step stop
line=$(dflash_job_stop "${stop[@]}") || fail $?
[ -z "$line" ] || say stopped "$line"

if [ -n "$dest" ]; then
  say step archive
  out=$(dflash_archive "$ckpt" "$dest") || fail $?
  [ "$out" != moved ] || say archived "$dest"
fi

say step start
line=$(dflash_job_start "$@") || fail $?
say started "$line"
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
class Deployed:
    release: str
    removed: list[str]
    stopped: JobState | None
    archived: str | None
    started: JobState


@dataclass(frozen=True, kw_only=True)
class DeployPlan:
    """Everything the script needs besides the bundle: the target's parts and the job."""

    setup: Setup
    releases: Releases
    job: Job
    lock: DeployLock
    checkpoints: checkpoints.Checkpoints
    launch: Sequence[str]  # the job's argv
    cwd: str
    env: dict[str, str]
    keep: int = release.KEEP


def argv(plan: DeployPlan, bundle: Bundle, owner: Owner, *, mode: str, archive: str) -> list[str]:
    probe = python_probe_argv(plan.setup)
    return [
        "bash", "-c", SCRIPT, "dflash-deploy",
        plan.releases.root, release.checked_id(bundle.release_id), str(plan.keep),
        plan.lock.path, owner.text(), mode, plan.checkpoints.path, archive,
        str(len(probe)), *probe,
        *plan.job.stop_args(),
        *plan.job.start_args(plan.launch, cwd=plan.cwd, env=plan.env),
    ]  # fmt: skip


def deploy(
    plan: DeployPlan,
    bundle: Bundle,
    *,
    resume: bool = False,
    force: bool = False,
    warn: Callable[[str], None] | None = None,
) -> Deployed:
    """Run the deploy at the place: one command when the lock is free, else one to find the
    holder, `DeployLock.acquire`'s own commands, and one more."""
    archive = "" if resume else plan.checkpoints.archive_dest()
    owner = Owner.me("deploy")
    outcome = _run(plan, bundle, owner, mode="take", archive=archive)
    if outcome.exit_code == HELD and outcome.held is not None:
        owner = plan.lock.acquire("deploy", force=force, held_by=outcome.held)
        try:
            outcome = _run(plan, bundle, owner, mode="held", archive=archive)
        except BaseException:
            plan.lock.release(owner)
            raise
    if outcome.exit_code != 0:
        raise _error(plan, bundle, outcome)
    started = outcome.fact("started")
    if started is None:
        raise _error(plan, bundle, outcome)
    stopped = outcome.fact("stopped")
    return Deployed(
        release=bundle.release_id,
        removed=sorted(outcome.facts.get("removed", [])),
        stopped=plan.job.parse_line(stopped) if stopped else None,
        archived=outcome.fact("archived"),
        started=plan.job.parse_line(started),
    )


def _run(plan: DeployPlan, bundle: Bundle, owner: Owner, *, mode: str, archive: str) -> Outcome:
    place = plan.releases.place
    result = place.run(
        argv(plan, bundle, owner, mode=mode, archive=archive),
        stdin=bundle.data,
        check=False,
        timeout=plan.job.stop_seconds() + 600.0,
    )
    outcome = Outcome.of(result)
    log.debug("deploy steps %s, exit %s", outcome.steps, outcome.exit_code)
    return outcome


def _error(plan: DeployPlan, bundle: Bundle, outcome: Outcome) -> DflashError:
    """The typed error of the step that failed, as that step raises it on its own."""
    step, stderr = outcome.step, outcome.stderr
    where = plan.releases.place.description
    if step in ("tmux", "python") and outcome.exit_code == _PREFLIGHT:
        code, _, out = (outcome.fact(step) or "").partition(" ")
        result = Result((step,), int(code) if code.isdigit() else outcome.exit_code,
                        out.encode(), stderr.encode())  # fmt: skip
        if step == "tmux":
            check = judge_tmux(plan.setup, where, result)
        else:
            check = judge_python(plan.setup, where, result, Findings())
        return doctor.failure(check)
    status = outcome.fact("failed")
    code = int(status) if status and status.isdigit() else outcome.exit_code
    if step == "unpack":
        return plan.releases.unpack_failed(bundle.release_id, stderr)
    if step == "switch":
        return plan.releases.switch_failed(bundle.release_id, stderr)
    if step == "start":
        try:
            plan.job.check_started(code, "", stderr)
        except DflashError as exc:
            return exc
    return RemoteCommandFailed(where, ("dflash-deploy", step), code, stderr)
