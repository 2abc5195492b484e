"""What a changing command's program at the place says while it runs, as the operator sees it,
and how long each of its steps may take (`StepWatch`).

`site.sh` announces each step (`step<TAB>NAME`) before running it, and prints `tick<TAB>SECONDS`
every few seconds for as long as it runs. `Progress.feed` reads that stdout as it arrives
(chunks, not lines): it says the steps that can take long as they begin and, on a tick during
a step that has lasted a while, how long it has been going. A wait at the place therefore never
looks like silence, and a real silence (a cut link) ends in the connection's keepalive verdict,
`ConnectionDropped`, which `dropped` words for the command: the step it had reached, what the
place may be left with, and what to do.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from dflash_ops.errors import CommandTimedOut, ConnectionDropped

Say = Callable[[str], None]
START_UP = "start-up"  # before the program's first step line
QUIET_FOR = 8.0  # a step shorter than this is not worth a "still …" line

# What a step does: named in a "still …" line and when the link drops there.
DOING = {
    "tmux": "checking tmux",
    "python": "checking the job's python",
    "lock": "taking the deploy lock",
    "unpack": "sending and unpacking the release",
    "check": "checking [train]",
    "expect": "checking that `current` is as read",
    "switch": "switching `current` to the release",
    "prune": "removing old releases",
    "current": "reading `current`",
    "clean": "removing unfinished releases",
    "stop": "stopping the job",
    "archive": "archiving the checkpoints",
    "start": "starting the job",
    "ready": "waiting until the job is past start-up",
    "done": "finishing",
}
# The steps that can take long, said as they begin.
SAID = {
    "unpack": "sending and unpacking the release",
    "check": "checking [train] with the trainer's own check",
    "stop": "stopping the job: SIGINT (it saves a checkpoint), SIGTERM after [job] stop_timeout",
}

# What the place may be left with when the link drops before the stop: the program there ends
# as soon as it sees its connection closed, having changed nothing else.
LEFT = {
    "start-up": "nothing had changed there yet",
    "clean": "nothing had changed there yet (unfinished releases may have been removed)",
    "tmux": "nothing had changed there yet",
    "python": "nothing had changed there yet",
    "lock": "nothing had changed there yet (the deploy lock may be held)",
    "unpack": "the new release may be there in part (the next deploy removes it); "
    "nothing else had changed",
    "check": "the new release may be there, unused; nothing else had changed",
    "current": "nothing had changed there yet",
    "expect": "nothing had changed there yet",
}
# From the stop on (site.sh's point of no return) the program goes on to the end by itself.
AFTER_STOP = frozenset({"stop", "switch", "prune", "archive", "start", "ready", "done"})
GOES_ON = {
    "deploy": "it switches `current` to the new release and starts it",
    "rollback": "it switches `current` to the earlier release and starts it",
    "restart": "it starts the job again on `current`",
    "stop": "the job ends",
}
PENDING_MAX = 64 * 1024  # a line longer than this is no step line: only its end is kept


class Progress:
    """Reads one run's stdout as it comes; `say` gets the operator's lines."""

    def __init__(self, doing: str, say: Say) -> None:
        self.doing = doing
        self.now: tuple[str, float] = (START_UP, time.monotonic())  # step, since: swapped whole
        self._say = say
        self._pending = b""

    @property
    def step(self) -> str:
        return self.now[0]

    def feed(self, chunk: bytes) -> None:
        self._pending += chunk
        *lines, rest = self._pending.split(b"\n")
        self._pending = rest[-PENDING_MAX:]
        for line in lines:
            key, _, value = line.decode("utf-8", "replace").partition("\t")
            if key == "step":
                self._begin(value)
            elif key == "tick":
                self._tick()

    def _begin(self, step: str) -> None:
        self.now = (step, time.monotonic())
        if step in SAID:
            self._say(f"… {SAID[step]}")

    def _tick(self) -> None:
        step, since = self.now
        lasted = time.monotonic() - since
        if lasted >= QUIET_FOR and step in DOING:
            self._say(f"… still {DOING[step]} ({lasted:.0f} s)")

    def dropped(self, place: str, exc: ConnectionDropped) -> ConnectionDropped:
        """The keepalive's verdict, said for this command at the step it had reached."""
        step = self.step
        at = (
            f", at its {step!r} step ({DOING[step]})"
            if step in DOING
            else ", before its first step"
        )
        lost = f"Lost the connection to {place} during dflash {self.doing}{at}: {exc.reason}."
        if step in AFTER_STOP:  # the place finishes the command by itself
            goes_on = GOES_ON.get(self.doing, "it goes on to the end")
            return ConnectionDropped(
                f"{lost} By then the running job was being stopped, the point from which the "
                f"program there goes on by itself to the end: {goes_on}.",
                reason=exc.reason,
                hint=(
                    "When the host answers again (ssh <host> true), dflash status shows what "
                    "runs there; dflash logs --follow reconnects by itself."
                ),
            )
        return ConnectionDropped(
            f"{lost} By then {LEFT.get(step, LEFT['start-up'])}. The program there ends as soon as it sees the "
            "connection closed (once the link is back) and releases the deploy lock.",
            reason=exc.reason,
            hint=(
                "When the host answers again (ssh <host> true), see what runs there with "
                f"dflash status, then run dflash {self.doing} again (it waits for the deploy lock "
                "while that program still ends). dflash logs --follow reconnects by itself."
            ),
        )


# What a step waits for at the place, in the message of one that overran.
_WAITS_FOR = {
    START_UP: "the place to start the program (its login shell, `pct exec`)",
    "tmux": "`tmux -V`",
    "python": "the job's python (the version probe)",
    "lock": "the deploy lock's folder",
    "unpack": "the release to arrive and unpack",
    "check": "the trainer's check of [train]",
    "stop": "the job to stop, and tmux",
    "start": "tmux to start the job",
    "ready": "the job's log to say it is past start-up",
}


class StepWatch:
    """How long the program's step now running may still take (`bounded.Watch`): `bound(step)`
    seconds from its start, the step and its start read from the step lines by `Progress`,
    which also says them to the operator."""

    def __init__(self, bound: Callable[[str], float], progress: Progress) -> None:
        self._bound = bound
        self._progress = progress

    def seen(self, data: bytes) -> None:
        self._progress.feed(data)

    def left(self) -> float:
        step, since = self._progress.now
        return since + self._bound(step) - time.monotonic()

    def overrun(self, doing: str, where: str, timeout: float) -> CommandTimedOut:
        """The error of the step that did not finish in time."""
        step, _ = self._progress.now
        waits = _WAITS_FOR.get(step, f"step {step}")
        if step in AFTER_STOP:  # the place's watcher is gone: the program is not ended with us
            then = (
                "dflash stopped waiting; from the stop on the program there goes on by itself "
                "(dflash status shows what runs)."
            )
        else:
            then = "the command was ended there, and nothing after that step ran."
        return CommandTimedOut(
            f"dflash {doing}: step {step} did not finish within {self._bound(step):g} s on "
            f"{where} (it waits for {waits}); {then}",
            hint="Look at the place: is something there hung (tmux, python, the disk)? If it is "
            f"only slow, raise timeout in the target's table of deploy.toml (now {timeout:g} s)"
            + (", or [job] stop_timeout." if step == "stop" else "."),
        )
