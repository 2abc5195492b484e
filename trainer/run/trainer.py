"""The training loop, one for every kind of run: builds the drafter, resumes from the newest
verified checkpoint, trains, logs, probes and checkpoints. Where the target's features come from
is its `FeatureSource` (`trainer.run.features`): a target in this process (`LocalTarget`, the
colocated run) or the target ranks of a split run (`TargetRanks`, `trainer.split.split_drafter`).

Exact resume: a checkpoint holds the drafter, AdamW and schedule states, the data position
(epoch, index), the step, and the torch RNG states; anchors and noise are drawn from generators
seeded by (seed, epoch, index) and (seed, global batch index), so a resumed run repeats the
uninterrupted run's losses, and a 1 + 1 split run repeats the colocated run's.

Every step, in order: the source's features, the drafter's step (its kernels queued, then the
next batch drawn on the host while they run, then its figures read), the step's summary (averaged
over the drafters of a split run), the τ probe every `eval.every` steps (`trainer.run.probe`), the
metrics row every `run.log_every` steps (and at probes and the last step), a checkpoint every
`run.checkpoint_every` steps and at `run.steps`. Stopping (`trainer.base.stopping`): after a
SIGINT/SIGTERM the step in progress finishes (a split run's drafters agree on the step), a
checkpoint of it is written (unless that step just wrote one) and `run` returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer.base.stopping import StopRequest, started_line, write_record
from trainer.data.dataset import DataPosition
from trainer.model import checkpoint as ckpt
from trainer.run.curves import TrainingCurves
from trainer.run.features import FeatureSource, LocalTarget, StepSummary
from trainer.run.metrics import METRICS, append_row
from trainer.run.pipeline import StepResult
from trainer.run.probe import ProbeReport
from trainer.run.profiling import ProfileReport, StepProfiler
from trainer.run.resume import (
    apply_schedule,
    find_checkpoint,
    resolved_values,
    start_clean,
    trim_metrics,
    warn_foreign,
)
from trainer.run.target_worker import compile_note
from trainer.settings.config import TrainConfig
from trainer.setup.runtime import resolve_demo, resolve_device

log = logging.getLogger("trainer")
__all__ = ["Trainer", "resolve_demo", "resolve_device"]


def _silent(_: str) -> None:
    pass


class Rate:
    """Tokens per second of training between two metrics rows: checkpoint writes and probes
    are left out (they are not training)."""

    def __init__(self) -> None:
        self.since = time.perf_counter()
        self.tokens = 0

    def count(self, tokens: int) -> None:
        self.tokens += tokens

    def exclude(self, seconds: float) -> None:
        self.since += seconds

    def take(self) -> float:
        now = time.perf_counter()
        rate = self.tokens / max(now - self.since, 1e-9)
        self.since, self.tokens = now, 0
        return rate


class Trainer:
    """One training run into `out_dir` (checkpoints, metrics.jsonl). Without `source`, the
    colocated run: the target is loaded here. `save_checkpoints=False` is for benchmarks only
    (a run that cannot be resumed)."""

    def __init__(
        self,
        config: TrainConfig,
        out_dir: str | Path,
        *,
        force_resume: bool = False,
        emit: Callable[[str], None] | None = None,
        stop: StopRequest | None = None,
        source: FeatureSource | None = None,
        save_checkpoints: bool = True,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.stop = stop
        self.save_checkpoints = save_checkpoints
        emit = emit or log.info
        self.lead = source is None or source.lead
        self.emit = emit if self.lead else _silent
        self.config = cfg = resolve_demo(config, self.out_dir) if source is None else config
        found, changes = find_checkpoint(
            cfg,
            self.out_dir,
            self.emit,
            force_resume,
            finished_ok=source is not None and source.collective,
        )
        self._foreign = {path for path, _ in ckpt.foreign(self.out_dir)}  # named just now
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        if source is None:
            source = LocalTarget(cfg, self.out_dir, resolve_device(cfg.run.device), emit)
        self.source = source
        self.device = source.device
        state = ckpt.load_state(found.path, map_location=self.device) if found.path else None
        self.step = int(state["step"]) if state else 0
        self.start_step = self.step
        source.start(self.step, DataPosition(**state["data_position"]) if state else DataPosition())
        torch.manual_seed(cfg.run.seed)  # the drafter's initial weights: the same in every run
        self.drafter_worker = source.drafter_worker(cfg)
        self.emit(self.drafter_worker.drafter.describe())
        note = compile_note(drafter=self.drafter_worker.compiled, target=source.target_compiled())
        if note:
            self.emit(note)
        if state is not None and found.path is not None:
            self._resume(state, found.path, changes)
        elif self.lead:
            start_clean(self.out_dir, self.emit)
        self._resolved = resolved_values(
            cfg,
            target_layers=source.target_layers(),
            worker=self.drafter_worker,
            device=self.device,
        )
        source.prepare(self.drafter_worker)
        self.last_probe: ProbeReport | None = None
        self.curves = TrainingCurves(
            self.out_dir, enabled=cfg.run.tensorboard and self.lead, start=self.step
        )
        self.rate = Rate()
        self.profiler = self._profiler()
        self.summary: dict[str, Any] = {}

    def _resume(self, state: dict, path: Path, changes: list[str]) -> None:
        self.drafter_worker.load_state_dict(state["worker"])
        torch.set_rng_state(state["rng"]["cpu"].cpu())
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), self.device)
        if self.lead:
            trim_metrics(self.out_dir, self.step, self.emit)
        self.emit(f"resumed from {path.name} (step {self.step})")
        if changes:
            apply_schedule(self.drafter_worker, self.config, self.step, changes, self.emit)

    def state(self) -> dict:
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        pos = self.source.position(self.step)
        return {
            "step": self.step,
            "worker": self.drafter_worker.state_dict(),
            "rng": rng,
            "data_position": {"epoch": pos.epoch, "index": pos.index},
        }

    def resolved(self) -> dict[str, Any]:
        """The values this run chose where the config says "automatic"."""
        return dict(self._resolved)

    def save(self) -> Path:
        began = time.perf_counter()
        path = ckpt.save_checkpoint(
            self.out_dir,
            self.step,
            self.state(),
            self.config,
            keep_last=self.config.run.keep_last,
            resolved=self.resolved(),
        )
        self.emit(f"checkpoint {path.name}")
        warn_foreign(self.out_dir, self.emit, self._foreign)
        self.rate.exclude(time.perf_counter() - began)
        return path

    def run(self, *, until: int | None = None) -> list[StepResult]:
        """Train up to step `until` (default: run.steps); returns this call's step results
        (this process's own, before any averaging over drafters)."""
        run = self.config.run
        until = run.steps if until is None else min(until, run.steps)
        results: list[StepResult] = []
        if self.stop is not None:
            self.stop.begin()
        self.emit(started_line(self.step, until))
        self.rate = Rate()
        profiler = self.profiler
        while self.step < until:
            if self._asked() and not results and not self.source.collective:
                self.emit(
                    f"stopped at step {self.step} before training a step: nothing new to save"
                )
                write_record("stopped")
                break
            profiler.before(self.step)
            features, index = self.source.next(self.step)
            pending = self.drafter_worker.launch_step(features, index)
            self.source.prefetch()  # the host draws the next batch while the device computes
            result = pending.result()
            self.step += 1
            self._profiled(profiler.after)
            results.append(result)
            summary = self.source.summarize(result, asked=self._asked())
            self.rate.count(summary.tokens)
            report = self._probe()
            if report is not None or self.step % run.log_every == 0 or self.step == until:
                self._log(summary, report)
            stopping = self.source.stop_now(self.step, summary)
            saved = self._checkpoint(stopping)
            if stopping:
                self._stopped(saved)
                break
        self._profiled(profiler.finish)
        self.summary = self.source.finish(self.step, self.drafter_worker.drafter)
        return results

    def _profiler(self) -> StepProfiler:
        """`run.profile_steps` steps after `run.profile_start`, once per trainer (a window that
        `run(until=…)` cuts short is written as it is), by every process that trains a drafter
        (each its own files in a split run)."""
        run = self.config.run
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else None
        return StepProfiler(
            self.out_dir,
            start=run.profile_start,
            count=run.profile_steps,
            device=self.device,
            name="" if rank is None else f"rank{rank}-",
        )

    def _profiled(self, stop_recording: Callable[[int], ProfileReport | None]) -> None:
        """Ends the profiler's window if it is due (`after`) or the loop is over (`finish`) and
        says where the recorded steps' time went; writing the files is not training."""
        began = time.perf_counter()
        report = stop_recording(self.step)
        if report is None:
            return
        self.rate.exclude(time.perf_counter() - began)
        self.emit(report.line())

    def _asked(self) -> bool:
        return self.stop is not None and self.stop.requested

    def _checkpoint(self, stopping: bool) -> Path | None:
        """At the cadence, at the last step and at a stop; by the lead alone."""
        every, steps = self.config.run.checkpoint_every, self.config.run.steps
        due = (every and self.step % every == 0) or self.step == steps or stopping
        if not (due and self.lead and self.save_checkpoints):
            return None
        return self.save()

    def _stopped(self, saved: Path | None) -> None:
        self.source.stopped(self.step)
        if not self.lead:
            return
        line = f"stopped at step {self.step}, checkpoint saved to {saved}"
        self.emit(line if saved else f"stopped at step {self.step} (checkpoints are off)")
        write_record(line)

    def _probe(self) -> ProbeReport | None:
        """τ on the held-out and training prompts every `eval.every` steps (`trainer.run.probe`;
        greedy: draws no random numbers, so resume stays exact)."""
        every = self.config.eval.every
        if not every or self.step % every:
            return None
        began = time.perf_counter()
        report = self.source.probe(self.drafter_worker.drafter, self.step)
        self.rate.exclude(time.perf_counter() - began)
        if report is None:
            return None
        self.last_probe = report
        if report.warning:
            self.emit(f"warning: step {self.step}: {report.warning}")
        return report

    def _log(self, s: StepSummary, report: ProbeReport | None) -> None:
        if not self.lead:
            return
        tps = self.rate.take()
        row: dict[str, Any] = {
            "step": self.step,
            "time": time.time(),
            "loss": s.loss,
            "ce": s.ce,
            "kl": s.kl,
            "cap": s.cap,
            "lr": s.lr,
            "tokens_per_s": tps,
            "slot_accuracy": s.slot_accuracy,
            "grad_norm": s.grad_norm,
            "tokens": s.tokens,
            "epochs": self.source.epochs(self.step),
        }
        if report is not None:
            row["tau"] = report.held_out.tau
            row["tau_interval"] = report.held_out.tau_interval
            row["slot_acceptance"] = report.held_out.slot_acceptance
            row["held_out_slot_accuracy"] = report.held_out.slot_accuracy
        if self.last_probe is not None:
            row["probe"] = self.last_probe.row()
        extra, suffix = self.source.extra()
        row.update(extra)
        acc = " ".join("--" if a is None else f"{100 * a:.0f}" for a in s.slot_accuracy)
        tau = report.log_fields() if report is not None else ""
        self.emit(
            f"step {self.step}/{self.config.run.steps} | loss {s.loss:.4f} ce {s.ce:.4f} "
            f"kl {s.kl:.4f} cap {s.cap:.4f} | acc% {acc}{tau} | {tps:,.0f} tok/s | "
            f"lr {s.lr:.2e} | gnorm {s.grad_norm:.2f}{suffix}"
        )
        append_row(self.out_dir / METRICS, row)
        self.curves.write(row)
