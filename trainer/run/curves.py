"""Training curves in TensorBoard: the metrics rows, drawn.

`metrics.jsonl` stays the record (`dflash status` and scripts read it); this writes the same rows
as TensorBoard scalars into `<out>/tensorboard/` so that a user can watch them:

    tensorboard --logdir <out>/tensorboard

Written only when the `tensorboard` package is installed (`pip install 'dflash[tensorboard]'`)
and `run.tensorboard` is on; otherwise nothing happens and nothing is said. The curves follow
the rule of `metrics.jsonl` (`trainer.run.metrics`): one series. The event file opens at the first
row with a purge marker at the step after the one the run started from (what
`SummaryWriter(purge_step=)` writes), so a run resumed from its checkpoint at step S hides every
point an earlier start drew after S, whether or not it logs those steps again, and a start from
scratch (whose earlier curves are set aside with its rows) begins clean; every row is flushed at
once (rows come every `run.log_every` steps, and a killed run keeps what it drew).

The events are written in the caller's thread with tensorboard's `RecordWriter`, not through
`SummaryWriter`'s writer thread: a full disk then raises here, where it is caught — the curves
stop with one warning and training goes on — instead of a traceback from a thread.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

FOLDER = "tensorboard"
log = logging.getLogger("trainer")

# metrics row key → scalar tag
SCALARS = {
    "loss": "loss/total",
    "ce": "loss/ce",
    "kl": "loss/kl",
    "cap": "loss/cap",
    "lr": "optim/lr",
    "grad_norm": "optim/grad_norm",
    "tokens_per_s": "throughput/tokens_per_s",
}
PROBE = {
    "tau": "tau/held_out",
    "tau_train": "tau/train_prompts",
    "tau_prompt_lookup": "tau/prompt_lookup",
}


def available() -> bool:
    """Whether the tensorboard package (its event protos and record writer) can be imported."""
    try:
        import tensorboard  # noqa: F401  (a probe: the trainer runs without it)
        from tensorboard.summary.writer.record_writer import RecordWriter  # noqa: F401
    except ImportError:
        return False
    return True


def scalars(row: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """(tag, value) of every number in a metrics row worth a curve."""
    for key, tag in SCALARS.items():
        if _number(row.get(key)):
            yield tag, float(row[key])
    yield from _slots("accuracy", row.get("slot_accuracy"))
    probe = row.get("probe")
    if isinstance(probe, Mapping) and probe.get("step") == row.get("step"):
        for key, tag in PROBE.items():
            if _number(probe.get(key)):
                yield tag, float(probe[key])
        yield from _slots("acceptance", row.get("slot_acceptance"))
        yield from _slots("held_out_accuracy", row.get("held_out_slot_accuracy"))
    roles = row.get("roles")
    if isinstance(roles, Mapping):
        for role, values in roles.items():
            if isinstance(values, Mapping) and _number(values.get("tokens_per_s")):
                yield f"throughput/{role}_tokens_per_s", float(values["tokens_per_s"])


def _slots(name: str, values: object) -> Iterator[tuple[str, float]]:
    """`name/slot_k` for slots k = 1 … B−1 (a slot without a value, e.g. no label, is skipped)."""
    for k, value in enumerate(values if isinstance(values, list) else [], start=1):
        if _number(value):
            yield f"{name}/slot_{k}", float(value)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


class TrainingCurves:
    """TensorBoard scalars of the metrics rows of one run folder, for a run that started from
    step `start` (its checkpoint's; 0 from scratch)."""

    def __init__(self, out_dir: str | Path, *, enabled: bool = True, start: int = 0) -> None:
        self.folder = Path(out_dir) / FOLDER
        self.enabled = enabled and available()
        self.start = start
        self._file: EventFile | None = None

    def write(self, row: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        step = int(row["step"])
        try:
            if self._file is None:
                self._file = EventFile(self.folder, purge_step=self.start + 1)
            for tag, value in scalars(row):
                self._file.scalar(tag, value, step)
            self._file.flush()
        except OSError as exc:  # a full disk: the curves stop, the training does not
            self.enabled = False
            log.warning(
                "warning: TensorBoard curves stopped at step %d: %s (%s); metrics.jsonl goes on",
                step,
                exc.strerror or exc,
                self.folder,
            )
            self.close()

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):  # the disk is full: nothing more to lose
                self._file.close()
            self._file = None


class EventFile:
    """One TensorBoard event file, written synchronously: a version event, a purge marker at
    `purge_step`, then scalar events."""

    def __init__(self, folder: Path, *, purge_step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog
        from tensorboard.summary.writer.record_writer import RecordWriter

        folder.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{time.time():.6f}.{socket.gethostname()}.{os.getpid()}"
        self._fh = open(folder / name, "ab")  # noqa: SIM115 (closed by `close`)
        self._records = RecordWriter(self._fh)
        self._write(Event(wall_time=time.time(), step=purge_step, file_version="brain.Event:2"))
        start = SessionLog(status=SessionLog.START)
        self._write(Event(wall_time=time.time(), step=purge_step, session_log=start))

    def scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary

        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value)])
        self._write(Event(wall_time=time.time(), step=step, summary=summary))

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())

    def flush(self) -> None:
        self._fh.flush()

    def close(self) -> None:
        self._fh.close()
