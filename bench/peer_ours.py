"""Ours' side of `bench/compare_peer.py`: this project's trainer on the same data and steps
(`Trainer`, the colocated run users start: the target in the same process), then its
exporter; and the drafter step alone at the 8B-shaped benchmark's shapes
(`bench/bench_pipeline.py`), for both trainers."""

from __future__ import annotations

import json
import shutil
import time
from typing import Any

import torch

from bench.common import environment, log
from bench.peer_common import Settings, ours_folder, peak_gib, steady, write_stage
from bench.peer_recipe import ours_config


def metric_windows(rows: list[dict[str, Any]], started: float) -> list[tuple[int, int, float]]:
    """(first step, last step, seconds) between consecutive metrics rows (`run.log_every`);
    the first window from `started`."""
    out, step, at = [], 0, started
    for row in rows:
        out.append((step, row["step"], row["time"] - at))
        step, at = row["step"], row["time"]
    return out


def train(settings: Settings) -> dict[str, Any]:
    """Train, time (its metrics rows), read the peak, export."""
    from trainer.export.folder import export
    from trainer.run.metrics import METRICS
    from trainer.run.trainer import Trainer

    device = torch.device(settings.device)
    run_dir = settings.root / "ours" / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # a previous checkpoint would be resumed
    config = ours_config(settings)
    trainer = Trainer(config, run_dir, emit=log)
    started = time.time()
    results = trainer.run()
    wall = time.time() - started
    peak = peak_gib(device)
    rows = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines()]
    layers = list(trainer.source.target.layers)  # type: ignore[attr-defined]
    del trainer
    out = ours_folder(settings)
    shutil.rmtree(out, ignore_errors=True)
    export(config, run_dir, out, dtype="bf16")
    return {
        "ok": True,
        "wall_s": wall,
        "peak_gib": peak,
        "steady": steady(metric_windows(rows, started), settings.warm_steps),
        "final_loss": results[-1].loss,
        "target_layers": layers,
        "compiled": config.run.compiles_on(device),
        "folder": str(out),
        "environment": environment(device),
    }


# ---- the drafter step alone, 8B-shaped ----------------------------------------------------------


def step_inputs(settings: Settings) -> dict[str, Any]:
    """`bench_pipeline`'s 8B-shaped spec (its smoke spec on the CPU), a random target of that
    shape on the device, and the features of the warm-up and timed batches (the same for both
    trainers: the same seed, data and target)."""
    import tempfile
    from pathlib import Path

    from bench.bench_pipeline import FULL, SMOKE, stream_batches, target_config, write_data
    from trainer.data.dataset import load_samples
    from trainer.model.target import load_target
    from trainer.run.target_worker import TargetWorker

    spec: dict[str, Any] = dict(SMOKE if settings.smoke else FULL)
    device = torch.device(settings.device)
    target = load_target(target_config(spec), device=device, num_layers=spec["features"], seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        write_data(data, spec)
        count = spec["warmup"] + settings.step_timed
        batches = stream_batches(spec, data, count)
        mask = torch.tensor(load_samples(data)[0].loss_mask)  # every sample supervises the same
    producer = TargetWorker(target)
    features = [producer.produce(b) for b in batches]
    return {"spec": spec, "target": target, "batches": batches, "features": features, "mask": mask}


def memory_mark(device: torch.device) -> int:
    """Memory allocated now, the peak counter reset: what the drafter's training adds is
    measured from here (the target and the features are already there, for both trainers)."""
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def timed_steps(
    step: Any, inputs: dict[str, Any], device: torch.device, base: int
) -> dict[str, Any]:
    """`step(i)` over the warm-up batches, then timed over the rest: seconds per step, and the
    peak memory above `base` (`memory_mark` before the drafter was built: its weights,
    optimizer state and steps)."""
    warm = inputs["spec"]["warmup"]
    for i in range(warm):
        step(i)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    timed = len(inputs["batches"]) - warm
    for i in range(warm, warm + timed):
        step(i)
    if cuda:
        torch.cuda.synchronize(device)
    step_s = (time.perf_counter() - t0) / timed
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**30 if cuda else None
    return {"step_s": step_s, "peak_gib": peak, "timed": timed, "warmup": warm}


def step_figures(
    timing: dict[str, Any], inputs: dict[str, Any], shape: Any, *, kl: bool
) -> dict[str, Any]:
    """tokens/s and MFU of the timed steps (`bench.flops.drafter_step_flops` of the drafter of
    `shape` on the timed batches; `kl`: with the KL term's target logits)."""
    from bench.flops import drafter_step_flops
    from bench.peer_common import PEAK_BF16

    timed = inputs["batches"][inputs["spec"]["warmup"] :]
    tokens = sum(b.num_tokens for b in timed) / len(timed)
    flops = sum(drafter_step_flops(shape, b, kl=kl) for b in timed) / len(timed)
    return {
        **timing,
        "tokens_per_s": tokens / timing["step_s"],
        "mfu": flops / timing["step_s"] / PEAK_BF16,
        "model_flops_per_step": flops,
    }


def drafter_step(settings: Settings) -> dict[str, Any]:
    """Ours' `DrafterWorker.train_step` on the precomputed features (as `trainer.commands.plan` times
    the drafter alone), with `bench_pipeline`'s recipe at that shape."""
    from pathlib import Path

    from bench.bench_pipeline import train_config
    from trainer.run.pipeline import DrafterWorker

    device = torch.device(settings.device)
    inputs = step_inputs(settings)
    cfg = train_config(inputs["spec"], Path("in-memory"), device=settings.device, steps=100)
    base = memory_mark(device)
    torch.manual_seed(0)
    worker = DrafterWorker.for_target(inputs["target"], cfg, device)
    features = inputs["features"]
    timing = timed_steps(lambda i: worker.train_step(features[i], i), inputs, device, base)
    shape = worker.drafter.shape
    figures = step_figures(timing, inputs, shape, kl=cfg.loss.kl_weight > 0)
    return {"ok": True, **figures, "compiled": worker.compiled, "shape": shape_row(inputs["spec"])}


def shape_row(spec: dict[str, Any]) -> dict[str, Any]:
    keys = ("seq_len", "num_anchors", "drafter_layers", "features", "block_size")
    return {"target": spec["target"], **{k: spec[k] for k in keys}, "batch_size": 1}


def stage(settings: Settings, name: str) -> None:
    """The child process of stage `name` (`ours-train` or `ours-step`)."""
    result = train(settings) if name == "ours-train" else drafter_step(settings)
    write_stage(settings, name, result)
