"""The training loop: builds the target, data, drafter and workers from a `TrainConfig`,
resumes from the newest verified checkpoint, logs every step and checkpoints every N steps.

Exact resume: a checkpoint holds the drafter, AdamW and schedule states, the data position
(epoch, index), the step, and the torch RNG states; anchors and noise are drawn from generators
seeded by (seed, epoch, index) and (seed, step), so a resumed run repeats the uninterrupted
run's losses.

Stopping (`trainer.stopping`): after a SIGINT/SIGTERM the step in progress finishes, a
checkpoint of it is written (unless that step just wrote one) and `run` returns.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer import checkpoint as ckpt
from trainer.config import TrainConfig, with_overrides
from trainer.curves import TrainingCurves
from trainer.data import BatchStream, DataPosition, load_data, repeat_note
from trainer.evaluate import split_holdout
from trainer.metrics import append_row, truncate_rows
from trainer.pipeline import COMPILE_NOTE, DrafterWorker, StepResult, TargetWorker, lr_at
from trainer.probe import ProbeReport, TauProbe
from trainer.stopping import StopRequest, write_record
from trainer.target import load_target

log = logging.getLogger("trainer")
METRICS = "metrics.jsonl"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_demo(config: TrainConfig, out_dir: Path) -> TrainConfig:
    """With `demo.enabled`, build (or reuse) the demo assets and point the run at them."""
    if not config.demo.enabled:
        return config
    from trainer.demo import ensure_demo_assets

    folder = (
        Path(config.demo.folder) if config.demo.folder else out_dir.resolve().parent / "demo-assets"
    )
    target_dir, data_path = ensure_demo_assets(folder, config.demo)
    return with_overrides(config, model={"target": str(target_dir)}, data={"path": str(data_path)})


class Trainer:
    """One training run into `out_dir` (checkpoints, metrics.jsonl)."""

    def __init__(
        self,
        config: TrainConfig,
        out_dir: str | Path,
        *,
        force_resume: bool = False,
        emit: Callable[[str], None] | None = None,
        stop: StopRequest | None = None,
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.emit = emit or log.info
        self.stop = stop
        self.config = resolve_demo(config, self.out_dir)
        cfg = self.config
        found, self.schedule_changes = find_checkpoint(cfg, self.out_dir, self.emit, force_resume)
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        self.device = resolve_device(cfg.run.device)
        torch.manual_seed(cfg.run.seed)
        target = load_target(
            cfg.model.target,
            device=self.device,
            layers=cfg.model.target_layers,
            num_layers=cfg.model.num_target_layers,
        )
        self.target_worker = TargetWorker(target)
        self.drafter_worker = DrafterWorker.for_target(target, cfg, self.device)
        if self.drafter_worker.compiled:
            self.emit(COMPILE_NOTE)
        samples = load_data(cfg, self.out_dir, emit=self.emit)
        samples, held_out = split_holdout(samples, cfg.data.holdout)
        self.probe = TauProbe.from_config(cfg, target, held_out, samples)
        self.last_probe: ProbeReport | None = None
        self.curves = TrainingCurves(self.out_dir, enabled=cfg.run.tensorboard)
        self.stream = BatchStream(
            samples, cfg.data, block_size=cfg.model.block_size, seed=cfg.run.seed
        )
        self.step = 0
        self._resume(found)

    def _resume(self, found: ckpt.Found) -> None:
        if found.path is None:
            return
        state = ckpt.load_state(found.path, map_location=self.device)
        self.drafter_worker.load_state_dict(state["worker"])
        self.stream.position = DataPosition(**state["data_position"])
        self.step = int(state["step"])
        torch.set_rng_state(state["rng"]["cpu"].cpu())
        if "cuda" in state["rng"] and self.device.type == "cuda":
            torch.cuda.set_rng_state(state["rng"]["cuda"].cpu(), self.device)
        trim_metrics(self.out_dir, self.step, self.emit)
        self.emit(f"resumed from {found.path.name} (step {self.step})")
        if self.schedule_changes:
            apply_schedule(
                self.drafter_worker, self.config, self.step, self.schedule_changes, self.emit
            )

    def state(self) -> dict:
        rng = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state(self.device)
        pos = self.stream.position
        return {
            "step": self.step,
            "worker": self.drafter_worker.state_dict(),
            "rng": rng,
            "data_position": {"epoch": pos.epoch, "index": pos.index},
        }

    def resolved(self) -> dict[str, Any]:
        """The values this run chose where the config says "automatic"."""
        return resolved_values(
            self.config,
            target_layers=self.target_worker.target.layers,
            worker=self.drafter_worker,
            device=self.device,
        )

    def save(self) -> Path:
        path = ckpt.save_checkpoint(
            self.out_dir,
            self.step,
            self.state(),
            self.config,
            keep_last=self.config.run.keep_last,
            resolved=self.resolved(),
        )
        self.emit(f"checkpoint {path.name}")
        return path

    def run(self, *, until: int | None = None) -> list[StepResult]:
        """Train up to step `until` (default: run.steps); returns this call's step results."""
        run = self.config.run
        until = run.steps if until is None else min(until, run.steps)
        results: list[StepResult] = []
        saved: Path | None = None
        if self.stop is not None:
            self.stop.begin()
        while self.step < until:
            if self.stop is not None and self.stop.requested and not results:
                self.emit(
                    f"stopped at step {self.step} before training a step: nothing new to save"
                )
                write_record("stopped")
                break
            start = time.perf_counter()
            epoch = self.stream.position.epoch
            features = self.target_worker.produce(self.stream.next_batch())
            if self.stream.position.epoch > epoch:
                self.emit(repeat_note(self.stream.position.epoch, len(self.stream.samples)))
            result = self.drafter_worker.train_step(features, self.step)
            self.step += 1
            elapsed = time.perf_counter() - start
            results.append(result)
            report = self._evaluate()  # after `elapsed`: tokens/s never counts the evaluation
            if report is not None or self.step % run.log_every == 0 or self.step == until:
                self._log(result, elapsed, report)
            saved = None
            if (
                run.checkpoint_every and self.step % run.checkpoint_every == 0
            ) or self.step == run.steps:
                saved = self.save()
            if self.stop is not None and self.stop.requested:
                self._stopped(saved or self.save())
                break
        return results

    def _stopped(self, path: Path) -> None:
        line = f"stopped at step {self.step}, checkpoint saved to {path}"
        self.emit(line)
        write_record(line)

    def _evaluate(self) -> ProbeReport | None:
        """τ on the held-out and training prompts every `eval.every` steps (`trainer.probe`;
        greedy: draws no random numbers, so resume stays exact)."""
        every = self.config.eval.every
        if self.probe is None or self.step % every:
            return None
        report = self.probe(self.drafter_worker.drafter, step=self.step)
        self.last_probe = report
        if report.warning:
            self.emit(f"warning: step {self.step}: {report.warning}")
        return report

    def _log(self, r: StepResult, elapsed: float, report: ProbeReport | None = None) -> None:
        tps = r.tokens / elapsed if elapsed > 0 else 0.0
        acc = " ".join("--" if a != a else f"{100 * a:.0f}" for a in r.slot_accuracy)
        tau = report.log_fields() if report is not None else ""
        self.emit(
            f"step {self.step}/{self.config.run.steps} | loss {r.loss:.4f} ce {r.ce:.4f} kl {r.kl:.4f} "
            f"cap {r.cap:.4f} | acc% {acc}{tau} | {tps:,.0f} tok/s | lr {r.lr:.2e} | gnorm {r.grad_norm:.2f}"
        )
        row = {
            "step": self.step,
            "time": time.time(),
            "loss": r.loss,
            "ce": r.ce,
            "kl": r.kl,
            "cap": r.cap,
            "lr": r.lr,
            "tokens_per_s": tps,
            "slot_accuracy": [None if a != a else a for a in r.slot_accuracy],
            "grad_norm": r.grad_norm,
            "tokens": r.tokens,
            "epochs": self.stream.epochs,
        }
        if report is not None:
            row["tau"] = report.held_out.tau
            row["slot_acceptance"] = report.held_out.slot_acceptance
        if self.last_probe is not None:
            row["probe"] = self.last_probe.row()
        append_row(self.out_dir / METRICS, row)
        self.curves.write(row)


def find_checkpoint(
    config: TrainConfig, out_dir: Path, emit: Callable[[str], None], force: bool
) -> tuple[ckpt.Found, list[str]]:
    """Before anything heavy is loaded: the checkpoint to resume (refused if its model/data
    settings differ, if its lr schedule differs without `run.extend`, or if the run is already
    finished) and the schedule changes to apply."""
    for path in ckpt.remove_stale_temps(out_dir):
        emit(f"removed {path.name}: an interrupted checkpoint write")
    found = ckpt.find_resumable(out_dir)
    for path, why in found.skipped:
        emit(f"skipped checkpoint {path.name}: {why}")
    if found.path is None:
        return found, []
    changed = ckpt.check_compatible(found, config, force=force)
    if changed:
        emit(f"resuming despite changed settings (--force-resume): {', '.join(changed)}")
    return found, ckpt.check_schedule(found, config)


def trim_metrics(out_dir: Path, step: int, emit: Callable[[str], None]) -> None:
    """Drop the metrics rows after the resumed step; say when a torn line was cut."""
    trimmed = truncate_rows(out_dir / METRICS, step)
    for why in trimmed.torn:
        emit(f"{METRICS}: cut an unreadable {why} (a write cut short, e.g. by a full disk)")


def apply_schedule(
    worker: DrafterWorker,
    config: TrainConfig,
    step: int,
    changes: list[str],
    emit: Callable[[str], None],
) -> None:
    """With `run.extend`: the new schedule replaces the checkpoint's from `step` on (its base lr
    too: the scheduler state would otherwise bring the old one back), and the log says so."""
    optim, total = config.optim, config.run.steps
    groups = worker.optimizer.param_groups
    before = groups[0]["lr"]
    worker.scheduler.base_lrs = [optim.lr for _ in groups]
    for group in groups:
        group["lr"] = optim.lr * lr_at(step, optim, total)
    emit(
        f"schedule changed on resume (run.extend): {'; '.join(changes)}; lr at step {step + 1} "
        f"{before:.2e} → {groups[0]['lr']:.2e}; warmup {optim.warmup_steps} steps, then cosine "
        f"from {optim.lr:.2e} to {optim.lr * optim.min_lr_ratio:.2e} at step {total}"
    )


def resolved_values(
    config: TrainConfig, *, target_layers: list[int], worker: DrafterWorker, device: torch.device
) -> dict[str, Any]:
    """The manifest's values of the automatic settings, as this run used them."""
    shape = worker.drafter.shape
    return {
        "model.target": str(Path(config.model.target).resolve()),
        "data.path": str(Path(config.data.path).resolve()),
        "model.target_layers": list(target_layers),
        "model.mask_token_id": shape.mask_token_id,
        "loss.gamma": worker.gamma,
        "run.device": str(device),
        "run.compile": worker.compiled,
    }
