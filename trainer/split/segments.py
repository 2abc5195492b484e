"""How a split run is cut in time and where its batches come from, shared by both roles.

A *segment* is the steps between two checkpoints; the targets fill it with exactly
`steps × drafters` batches (`trainer.split.exchange`). A batch is named by its global index over the
run; `batch_index`/`position_of` turn a data position into that index and back, so a checkpoint
written by a drafter (which never sees the data) still records where the data stand.
`StopWatch` is how all ranks agree on the step a graceful stop ends after.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.base.stopping import StopRequest
from trainer.data.dataset import DataPosition
from trainer.split.distributed import Session


@dataclass(frozen=True)
class Segment:
    """Steps [start, end) between two checkpoints; its batches are offsets 0 … steps·D−1."""

    start: int
    end: int

    @property
    def key(self) -> int:
        return self.end

    @property
    def steps(self) -> int:
        return self.end - self.start


def segments(start: int, total: int, checkpoint_every: int) -> list[Segment]:
    """The segments from step `start` (a resumed run may start between two checkpoints)."""
    out, step = [], start
    while step < total:
        end = total
        if checkpoint_every:
            end = min(total, (step // checkpoint_every + 1) * checkpoint_every)
        out.append(Segment(step, end))
        step = end
    return out


def batch_index(position: DataPosition, *, per_epoch: int, batch_size: int) -> int:
    """Global index of the batch a stream at `position` draws next."""
    return position.epoch * per_epoch + position.index // batch_size


def position_of(index: int, *, per_epoch: int, batch_size: int) -> DataPosition:
    """Inverse of `batch_index`: where batch `index` starts (epochs drop the ragged tail)."""
    return DataPosition(index // per_epoch, (index % per_epoch) * batch_size)


class StopWatch:
    """A rank's view of a graceful stop. Any rank whose own `StopRequest` fired says so in the
    store (`stop_requested`); the drafters agree on it in their per-step all-reduce and publish
    the step they stop after (`stop_at`); targets then produce only the batches up to it."""

    def __init__(self, session: Session, stop: StopRequest) -> None:
        self.session = session
        self.stop = stop
        self.at: int | None = None
        self._told = False

    def requested(self) -> bool:
        """This rank's signal, or any other rank's (drafters ask once per step)."""
        store = self.session.store
        if self.stop.requested and not self._told:
            store.set("stop_requested", self.stop.signal_name or "stop")
            self._told = True
        return self._told or store.check(["stop_requested"])

    def decide(self, step: int) -> None:
        """Drafters: the agreed last step."""
        self.at = step
        self.session.store.set("stop_at", str(step))

    def __call__(self) -> bool:
        """Whether the drafters have agreed on a stop (targets poll this)."""
        self.requested()
        store = self.session.store
        if self.at is None and store.check(["stop_at"]):
            self.at = int(store.get("stop_at"))
        return self.at is not None

    def bound(self, seg: Segment, drafters: int) -> int:
        """How many batches of `seg` are trained before the stop (all without one)."""
        if not self() or self.at is None:
            return seg.steps * drafters
        return max(0, min(seg.steps, self.at - seg.start)) * drafters

    def past(self, seg: Segment) -> bool:
        return self() and self.at is not None and self.at <= seg.end
