"""What a run does with its folder before the first step: the checkpoint to resume (and the
settings that must match it), the metrics rows and curves after it cut or set aside, the
schedule changes `run.extend` allows, and the manifest's values of the automatic settings."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer.model import checkpoint as ckpt
from trainer.run import curves
from trainer.run.metrics import METRICS, set_aside, truncate_rows
from trainer.run.pipeline import DrafterWorker, lr_at
from trainer.settings.config import TrainConfig


def find_checkpoint(
    config: TrainConfig,
    out_dir: Path,
    emit: Callable[[str], None],
    force: bool,
    *,
    finished_ok: bool = False,
) -> tuple[ckpt.Found, list[str]]:
    """Before anything heavy is loaded: the checkpoint to resume (refused if its model/data
    settings differ, if its lr schedule differs without `run.extend`, or if the run is already
    finished) and the schedule changes to apply. `finished_ok`: a finished run is said and
    resumed at its end, so it trains no step (every rank of a split run then ends normally)."""
    warn_foreign(out_dir, emit, set())
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
    try:
        return found, ckpt.check_schedule(found, config)
    except ckpt.RunFinished as exc:
        if not finished_ok:
            raise
        emit(str(exc))
        return found, []


def warn_foreign(out_dir: Path, emit: Callable[[str], None], named: set[Path]) -> None:
    """Name each entry of the run folder that looks like a checkpoint but is not the trainer's
    (`ckpt.foreign`), once: it is left alone, and the operator should know why."""
    for path, what in ckpt.foreign(out_dir):
        if path not in named:
            named.add(path)
            emit(f"warning: left alone {path.name}: {what} the trainer did not make")


def trim_metrics(out_dir: Path, step: int, emit: Callable[[str], None]) -> None:
    """Drop the metrics rows after the resumed step; say when a torn line was cut."""
    trimmed = truncate_rows(out_dir / METRICS, step)
    for why in trimmed.torn:
        emit(f"{METRICS}: cut an unreadable {why} (a write cut short, e.g. by a full disk)")


def start_clean(out_dir: Path, emit: Callable[[str], None]) -> None:
    """A start from scratch begins a new series: the rows and curves an earlier start left
    (killed before its first checkpoint, so there is nothing to resume) are set aside, never
    continued (the steps would start over in the same file) nor deleted."""
    moved = set_aside(out_dir, (METRICS, curves.FOLDER))
    if moved is not None:
        emit(
            f"no checkpoint to resume: {METRICS} and the curves of an earlier start moved to "
            f"{moved}"
        )


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
