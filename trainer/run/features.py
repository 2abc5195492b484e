"""Where a `Trainer` gets the target's features from: the one seam between the colocated run
and the split run.

`FeatureSource` is what the training loop (`trainer.run.trainer`) asks of either:
- `LocalTarget` (here): this process holds the target, the data (the `data.holdout` samples
  kept out) and the τ probe; every step it draws the next batch and runs the target on it;
- `TargetRanks` (`trainer.split.split_drafter`): a drafter rank of a split run; the features come
  from the target ranks, the step's figures are averaged over the drafters, they agree on the
  step a stop ends after, and the τ probe runs on target rank 0 (`trainer.split.probe_link`).
Resume, checkpoint cadence, the probe schedule, graceful stop, metrics rows and TensorBoard
curves are the loop's, written once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from trainer.data.dataset import (
    Batch,
    BatchStream,
    DataPosition,
    Sample,
    load_data,
    repeat_note,
    split_holdout,
    template_options,
)
from trainer.model.drafter import Drafter
from trainer.model.linear_attention import describe as describe_linear_attention
from trainer.model.target import Target
from trainer.run.pipeline import DrafterWorker, StepResult
from trainer.run.probe import ProbeReport, TauProbe
from trainer.run.target_worker import Features, TargetWorker
from trainer.settings.config import TrainConfig
from trainer.setup.runtime import load_configured_target


@dataclass(frozen=True, kw_only=True)
class StepSummary:
    """One optimizer step as logged: loss terms and slot accuracies (means over the drafters
    that trained it), tokens (their sum); `stop`: whether any rank asked to stop."""

    loss: float
    ce: float
    kl: float
    cap: float
    lr: float
    grad_norm: float
    tokens: int
    slot_accuracy: list[float | None]  # None: no label in that slot
    stop: bool = False

    @classmethod
    def of(cls, r: StepResult, *, stop: bool = False) -> StepSummary:
        return cls(
            loss=r.loss,
            ce=r.ce,
            kl=r.kl,
            cap=r.cap,
            lr=r.lr,
            grad_norm=r.grad_norm,
            tokens=r.tokens,
            slot_accuracy=[None if math.isnan(a) else a for a in r.slot_accuracy],
            stop=stop,
        )


class FeatureSource(Protocol):
    """What the training loop needs from wherever the features come from."""

    device: torch.device
    lead: bool  # this process writes the log, the metrics rows and the checkpoints
    collective: bool  # several processes train together (a finished run then ends quietly)

    def start(self, step: int, position: DataPosition) -> None:
        """Training resumes after `step` steps with the data at `position`."""

    def drafter_worker(self, config: TrainConfig) -> DrafterWorker:
        """A new drafter shaped after the target (the global generator already seeded)."""

    def target_layers(self) -> list[int]: ...

    def target_compiled(self) -> bool:
        """Whether the target's forward that feeds this run is compiled (`run.compile_target`)."""

    def prepare(self, worker: DrafterWorker) -> None:
        """After the worker's state is loaded, before the first step (e.g. DDP)."""

    def next(self, step: int) -> tuple[Features, int]:
        """The features step `step + 1` trains and the batch's global index (its noise)."""

    def prefetch(self) -> None:
        """While the step just launched runs on the device: the host's share of the next
        `next` (drawing a batch), done ahead. Changes no position a checkpoint records."""

    def summarize(self, result: StepResult, *, asked: bool) -> StepSummary:
        """The step as logged; `asked`: this process's stop request."""

    def stop_now(self, step: int, summary: StepSummary) -> bool:
        """Whether the run stops after `step` (the same step on every process)."""

    def position(self, step: int) -> DataPosition:
        """The data position after `step` steps (what a checkpoint of that step records)."""

    def epochs(self, step: int) -> float:
        """Passes over the training samples after `step` steps."""

    def probe(self, drafter: Drafter, step: int) -> ProbeReport | None:
        """The τ probe of `drafter` at `step` (None on processes that do not log)."""

    def extra(self) -> tuple[dict[str, Any], str]:
        """Fields this kind of run adds to a metrics row, and to its log line."""

    def stopped(self, step: int) -> None:
        """The loop ended on a stop at `step` (its checkpoint written)."""

    def finish(self, step: int, drafter: Drafter) -> dict[str, Any]:
        """The loop is over; this process's summary."""


def run_samples(
    config: TrainConfig, out_dir: str | Path, emit: Callable[[str], None] | None = None
) -> Sequence[Sample]:
    """The run's `[data]`, tokenized with the target's tokenizer, cached by its run folder."""
    return load_data(config.data, out_dir, tokenizer_dir=config.model.target or None, emit=emit)


def run_tau_probe(
    config: TrainConfig, target: Target, held_out: Sequence[Sample], trained: Sequence[Sample]
) -> TauProbe | None:
    """The τ probe the run's `[eval]` asks for, its prompts rendered as `[data]` renders chats."""
    return TauProbe.of(
        config.eval, target, held_out, trained,
        tokenizer_dir=config.model.target, template=template_options(config.data),
        block_size=config.model.block_size,
    )  # fmt: skip


class LocalTarget:
    """The colocated run's source: target, data and probe in this process."""

    lead = True
    collective = False

    def __init__(
        self, config: TrainConfig, out_dir: Path, device: torch.device, emit: Callable[[str], None]
    ) -> None:
        self.device = device
        self.emit = emit
        self.target = load_configured_target(config, device)
        if line := describe_linear_attention(self.target.config, device_type=device.type):
            emit(line)
        self.worker = TargetWorker.for_run(self.target, config)
        samples, held_out = split_holdout(run_samples(config, out_dir, emit), config.data.holdout)
        self.tau_probe = run_tau_probe(config, self.target, held_out, samples)
        self.stream = BatchStream(
            samples, config.data, block_size=config.model.block_size, seed=config.run.seed
        )
        # the position after the batches handed out; the stream is one batch ahead of it
        # while a drawn batch waits in `_ahead`
        self._trained = DataPosition()
        self._ahead: tuple[Batch, DataPosition] | None = None

    def start(self, step: int, position: DataPosition) -> None:
        self.stream.position = self._trained = position
        self._ahead = None

    def drafter_worker(self, config: TrainConfig) -> DrafterWorker:
        return DrafterWorker.for_target(self.target, config, self.device)

    def target_layers(self) -> list[int]:
        return list(self.target.layers)

    def target_compiled(self) -> bool:
        return self.worker.compiled

    def prepare(self, worker: DrafterWorker) -> None:
        pass

    def next(self, step: int) -> tuple[Features, int]:
        before = self._trained
        batch, self._trained = self._ahead or self._draw()
        self._ahead = None
        if self._trained.epoch > before.epoch:
            self.emit(repeat_note(self._trained.epoch, len(self.stream.samples)))
        return self.worker.produce(batch), step

    def prefetch(self) -> None:
        if self._ahead is None:
            self._ahead = self._draw()

    def _draw(self) -> tuple[Batch, DataPosition]:
        batch = self.stream.next_batch()
        return batch, self.stream.position

    def summarize(self, result: StepResult, *, asked: bool) -> StepSummary:
        return StepSummary.of(result, stop=asked)

    def stop_now(self, step: int, summary: StepSummary) -> bool:
        return summary.stop

    def position(self, step: int) -> DataPosition:
        return self._trained

    def epochs(self, step: int) -> float:
        return self.stream.epochs_at(self._trained)

    def probe(self, drafter: Drafter, step: int) -> ProbeReport | None:
        return None if self.tau_probe is None else self.tau_probe(drafter, step=step)

    def extra(self) -> tuple[dict[str, Any], str]:
        return {}, ""

    def stopped(self, step: int) -> None:
        pass

    def finish(self, step: int, drafter: Drafter) -> dict[str, Any]:
        return {"role": "colocated", "step": step}
