"""The training loop: builds the target, data, drafter and workers from a `TrainConfig`,
resumes from the newest verified checkpoint, logs every step and checkpoints every N steps.

Exact resume: a checkpoint holds the drafter, AdamW and schedule states, the data position
(epoch, index), the step, and the torch RNG states; anchors and noise are drawn from generators
seeded by (seed, epoch, index) and (seed, step), so a resumed run repeats the uninterrupted
run's losses.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trainer import checkpoint as ckpt
from trainer.config import TrainConfig, with_overrides
from trainer.curves import TrainingCurves
from trainer.data import BatchStream, DataPosition, load_data, repeat_note
from trainer.evaluate import split_holdout
from trainer.pipeline import COMPILE_NOTE, DrafterWorker, StepResult, TargetWorker
from trainer.probe import ProbeReport, TauProbe
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
    ) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.emit = emit or log.info
        self.config = resolve_demo(config, self.out_dir)
        cfg = self.config
        found = self._find_checkpoint(force_resume)
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

    def _find_checkpoint(self, force: bool) -> ckpt.Found:
        """Before anything heavy is loaded: the checkpoint to resume, refused if incompatible."""
        for path in ckpt.remove_stale_temps(self.out_dir):
            self.emit(f"removed {path.name}: an interrupted checkpoint write")
        found = ckpt.find_resumable(self.out_dir)
        for path, why in found.skipped:
            self.emit(f"skipped checkpoint {path.name}: {why}")
        if found.path is not None:
            changed = ckpt.check_compatible(found, self.config, force=force)
            if changed:
                self.emit(
                    f"resuming despite changed settings (--force-resume): {', '.join(changed)}"
                )
        return found

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
        self._truncate_metrics(self.step)
        self.emit(f"resumed from {found.path.name} (step {self.step})")

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

    def save(self) -> Path:
        path = ckpt.save_checkpoint(
            self.out_dir, self.step, self.state(), self.config, keep_last=self.config.run.keep_last
        )
        self.emit(f"checkpoint {path.name}")
        return path

    def run(self, *, until: int | None = None) -> list[StepResult]:
        """Train up to step `until` (default: run.steps); returns this call's step results."""
        run = self.config.run
        until = run.steps if until is None else min(until, run.steps)
        results = []
        while self.step < until:
            start = time.perf_counter()
            epoch = self.stream.position.epoch
            features = self.target_worker.produce(self.stream.next_batch())
            if self.stream.position.epoch > epoch:
                self.emit(repeat_note(self.stream.position.epoch, len(self.stream.samples)))
            result = self.drafter_worker.train_step(features, self.step)
            self.step += 1
            elapsed = time.perf_counter() - start
            results.append(result)
            report = self._evaluate()
            if report is not None or self.step % run.log_every == 0 or self.step == until:
                self._log(result, elapsed, report)
            if (
                run.checkpoint_every and self.step % run.checkpoint_every == 0
            ) or self.step == run.steps:
                self.save()
        return results

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
        with open(self.out_dir / METRICS, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        self.curves.write(row)

    def _truncate_metrics(self, step: int) -> None:
        """Drop metrics logged after the checkpoint we resume from (they will be logged again)."""
        path = self.out_dir / METRICS
        if not path.is_file():
            return
        keep = [
            line
            for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step
        ]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
