"""What the operator sees of a changing command while the place's program runs (`remote/
progress.py`), fed the program's own stdout as it arrives: the long steps said as they begin,
"still …" on its ticks, and a dropped connection worded with the step it had reached."""

from __future__ import annotations

import pytest

from dflash_ops.errors import ConnectionDropped
from dflash_ops.remote import progress
from dflash_ops.remote.client import SITE
from dflash_ops.remote.progress import Progress

# what site.sh prints for a deploy up to its stop step, with a tick while the job stops
DEPLOY = (
    b"step\ttmux\ntmux\t0 tmux 3.3a\nstep\tpython\npython\t0 ok\nstep\tlock\nstep\tunpack\n"
    b"step\tcheck\nstep\tstop\ntick\t10\n"
)


def feed_in_pieces(seen: Progress, data: bytes, size: int) -> None:
    for start in range(0, len(data), size):
        seen.feed(data[start : start + size])


@pytest.mark.parametrize("size", [1, 7, 4096])
def test_steps_are_said_as_they_begin_in_whatever_pieces_they_come(
    size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(progress, "QUIET_FOR", 0.0)  # every tick is worth a line here
    said: list[str] = []
    seen = Progress("deploy", said.append)
    feed_in_pieces(seen, DEPLOY, size)
    assert said == [
        "… sending and unpacking the release",
        "… checking [train] with the trainer's own check",
        "… stopping the job: SIGINT (it saves a checkpoint), SIGTERM after [job] stop_timeout",
        "… still stopping the job (0 s)",
    ]
    assert seen.step == "stop"


def test_a_short_step_is_not_said_again_on_a_tick() -> None:
    said: list[str] = []
    seen = Progress("stop", said.append)
    seen.feed(b"step\tlock\nstep\tstop\ntick\t10\n")
    assert said == [said[0]] and said[0].startswith("… stopping the job")


def test_a_drop_names_the_command_the_step_and_what_the_place_may_be_left_with() -> None:
    seen = Progress("deploy", lambda _: None)
    seen.feed(DEPLOY)
    why = "no answer from root@host:22 for 20 s (3 keepalive probes unanswered; …)"
    dropped = seen.dropped("root@host:22", ConnectionDropped("lost", reason=why))
    text = str(dropped)
    assert text.startswith("Lost the connection to root@host:22 during dflash deploy, at its")
    assert "'stop' step (stopping the job)" in text and why in text
    assert "goes on by itself to the end" in text
    assert "switches `current` to the new release and starts it" in text
    assert "dflash status" in dropped.hint
    early = Progress("stop", lambda _: None).dropped("h", ConnectionDropped("x", reason="y"))
    assert "before its first step" in str(early) and "nothing had changed" in str(early)
    assert "dflash stop again" in early.hint
    checking = Progress("deploy", lambda _: None)
    checking.feed(b"step\tlock\nstep\tunpack\nstep\tcheck\n")
    text = str(checking.dropped("h", ConnectionDropped("x", reason="y")))
    assert "'check' step" in text and "unused; nothing else had changed" in text


def test_every_step_of_the_program_has_its_words() -> None:
    """A step added to site.sh without words here would be said as nothing."""
    steps = {line.split("say step ", 1)[1].split()[0].strip("'") for line in SITE.splitlines()
             if "say step " in line}  # fmt: skip
    assert steps and steps <= set(progress.DOING)
    assert steps <= set(progress.LEFT) | progress.AFTER_STOP
    assert not set(progress.LEFT) & progress.AFTER_STOP


def test_a_line_without_end_is_not_kept_whole() -> None:
    seen = Progress("deploy", lambda _: None)
    seen.feed(b"x" * (3 * progress.PENDING_MAX))
    assert len(seen._pending) == progress.PENDING_MAX  # what untrusted output can make it hold
    seen.feed(b"\nstep\tunpack\n")
    assert seen.step == "unpack"
