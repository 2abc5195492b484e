"""Plan the target/drafter split of a node: measure each role alone, predict every split.

    python -m trainer plan --config FILE [--gpus 8] [--json] [--set key=value …]

It loads the configured target and builds the drafter, then times, on real batches of the
configured data (sequence buckets, anchors, batch size):
- the target forward alone (`TargetWorker.produce`) → r_target tokens/s on one device;
- the drafter training step alone (`DrafterWorker.train_step` on features produced beforehand)
  → r_drafter tokens/s on one device (the second GPU when there is one, else the same device).
A split of G GPUs into T targets and D = G − T drafters cannot train faster than its slower side,
so its predicted rate is min(T·r_target, D·r_drafter); the colocated rate of one GPU running both
is 1 / (1/r_target + 1/r_drafter). On a GPU it also reports the peak memory of a rank of each
role (the drafter's without the target's weights where both ran on one device). The first
steps (compiles, allocator warm-up), and one step of every batch shape the timed steps meet, are
not timed. Beside the best split it marks the default one, what the trainer runs without
`DFLASH_TARGET_GPUS`: the best split of the two roles' model FLOPs per token at the configured
shapes (`trainer.split.split_shapes`), with those FLOPs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from trainer.base.errors import TrainerError
from trainer.settings.config import TrainConfig
from trainer.settings.loading import config_options, load_config
from trainer.split.split_rule import Split, best_split, default_target_gpus, predict_splits
from trainer.split.split_shapes import RoleWork, role_work

if TYPE_CHECKING:
    from trainer.data.dataset import Batch


@dataclass(frozen=True, kw_only=True)
class Rates:
    r_target: float  # tokens/s of one target worker
    r_drafter: float  # tokens/s of one drafter worker
    tokens_per_batch: float
    target_s_per_batch: float
    drafter_s_per_batch: float
    target_device: str
    drafter_device: str
    # peak GPU memory of a rank of each role (None on the CPU): the target's forward with its
    # weights; the drafter's step with its weights, optimizer and features, without the target
    target_peak_gib: float | None = None
    drafter_peak_gib: float | None = None


def predict(rates: Rates, gpus: int) -> list[Split]:
    """Every split T + D = gpus with T, D ≥ 1, predicted tokens/s = min(T·r_t, D·r_d)
    (`trainer.split.split_rule.predict_splits`)."""
    return predict_splits(rates.r_target, rates.r_drafter, gpus)


def colocated(rates: Rates) -> float:
    return 1.0 / (1.0 / rates.r_target + 1.0 / rates.r_drafter)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def batch_shape(batch: Batch) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What decides the compiled kernels a batch runs: its padded ids and its anchors."""
    return tuple(batch.input_ids.shape), tuple(batch.anchors.shape)


def warmup_batches(warmup: list[Batch], timed: list[Batch]) -> list[Batch]:
    """The untimed batches: `warmup`, then the first timed batch of every shape that `warmup`
    has not met, so that no compile (a new length bucket compiles for minutes on a GPU) falls
    inside the timed steps."""
    seen = {batch_shape(b) for b in warmup}
    extra = []
    for b in timed:
        if (shape := batch_shape(b)) not in seen:
            seen.add(shape)
            extra.append(b)
    return [*warmup, *extra]


def measure_rates(
    config: TrainConfig,
    *,
    target=None,
    target_device: torch.device | None = None,
    drafter_device: torch.device | None = None,
    warmup: int = 2,
    steps: int = 5,
    out_dir: str | Path = "runs/plan",
) -> Rates:
    """Time each role alone on the configured model and batches (see the module docstring).
    `target`: an already loaded `trainer.model.target.Target` (else `model.target` is loaded)."""
    from trainer.data.dataset import BatchStream
    from trainer.run.features import run_samples
    from trainer.run.pipeline import DrafterWorker
    from trainer.run.target_worker import TargetWorker
    from trainer.setup.runtime import load_configured_target, resolve_device

    tdev = target_device or resolve_device(config.run.device)
    if drafter_device is None:
        drafter_device = tdev
        if tdev.type == "cuda" and torch.cuda.device_count() > 1:
            drafter_device = torch.device("cuda", (tdev.index or 0) + 1)
    m = config.model
    if target is None:
        target = load_configured_target(config, tdev)
    stream = BatchStream(
        run_samples(config, out_dir),
        config.data,
        block_size=m.block_size,
        seed=config.run.seed,
    )
    producer = TargetWorker.for_run(target, config)
    batches = [stream.next_batch() for _ in range(warmup + steps)]
    timed = batches[warmup:]
    untimed = warmup_batches(batches[:warmup], timed)
    tokens = sum(b.num_tokens for b in timed) / steps

    warm = [producer.produce(b) for b in untimed]  # also the drafter's warm-up steps
    _sync(tdev)
    _reset_peak(tdev)
    start = time.perf_counter()
    features = [producer.produce(b) for b in timed]
    _sync(tdev)
    t_target = (time.perf_counter() - start) / steps
    target_peak = _peak_gib(tdev)

    torch.manual_seed(config.run.seed)
    worker = DrafterWorker.for_target(target, config, drafter_device)
    for i, f in enumerate(warm):
        worker.train_step(f.to(drafter_device), i)
    moved = [f.to(drafter_device) for f in features]
    del warm, features
    _sync(drafter_device)
    _reset_peak(drafter_device)
    start = time.perf_counter()
    for i, f in enumerate(moved, start=len(untimed)):
        worker.train_step(f, i)
    _sync(drafter_device)
    t_drafter = (time.perf_counter() - start) / steps
    drafter_peak = _peak_gib(drafter_device)
    if drafter_peak is not None and drafter_device == tdev:  # the target's weights are not its
        drafter_peak -= sum(p.nbytes for p in target.model.parameters()) / _GIB
    return Rates(
        r_target=tokens / t_target,
        r_drafter=tokens / t_drafter,
        tokens_per_batch=tokens,
        target_s_per_batch=t_target,
        drafter_s_per_batch=t_drafter,
        target_device=str(tdev),
        drafter_device=str(drafter_device),
        target_peak_gib=target_peak,
        drafter_peak_gib=drafter_peak,
    )


_GIB = float(1 << 30)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / _GIB if device.type == "cuda" else None


def report(rates: Rates, gpus: int, *, work: RoleWork | None = None) -> dict:
    """Every split's prediction, the best one, and the default split (what `[job] target_gpus
    = 0` runs) so that the two can be compared: the one of the roles' `work` per token
    (`trainer.split.split_shapes`), ⌊G/2⌋ without it (`trainer.split.split_rule`)."""
    splits = predict(rates, gpus)
    best = best_split(splits)
    targets = work.target_gpus(gpus) if work else default_target_gpus(gpus)
    default = next((s for s in splits if s.targets == targets), None)
    return {
        "gpus": gpus,
        "rates": asdict(rates),
        "colocated_tokens_per_s": colocated(rates),
        "splits": [asdict(s) for s in splits],
        "best": asdict(best) if best else None,
        "default": asdict(default) if default else None,
        "default_from": asdict(work) if work else None,
    }


def format_report(r: dict) -> str:
    rt = r["rates"]
    lines = [
        f"target alone:  {rt['r_target']:,.0f} tok/s ({1e3 * rt['target_s_per_batch']:.1f} ms "
        f"per batch of {rt['tokens_per_batch']:,.0f} tokens, {rt['target_device']})",
        f"drafter alone: {rt['r_drafter']:,.0f} tok/s ({1e3 * rt['drafter_s_per_batch']:.1f} ms "
        f"per batch, {rt['drafter_device']})",
        f"one GPU colocated: {r['colocated_tokens_per_s']:,.0f} tok/s",
        *_memory_lines(rt),
        *_default_lines(r.get("default_from")),
        "",
        f"{'targets':>7} {'drafters':>8} {'tok/s':>12}  bound by",
    ]
    best, default = r["best"], r.get("default")
    for s in r["splits"]:
        marks = [
            name
            for name, split in (("best", best), ("default", default))
            if split and s["targets"] == split["targets"]
        ]
        mark = f"  <- {', '.join(marks)}" if marks else ""
        lines.append(
            f"{s['targets']:>7} {s['drafters']:>8} {s['tokens_per_s']:>12,.0f}  {s['bound_by']}{mark}"
        )
    if not r["splits"]:
        lines.append("(one GPU: colocated only)")
    return "\n".join(lines)


def _memory_lines(rates: dict) -> list[str]:
    """The memory a rank of each role peaked at, where measured on a GPU."""
    t, d = rates.get("target_peak_gib"), rates.get("drafter_peak_gib")
    if t is None and d is None:
        return []
    shown = [f"{role} {v:.1f} GiB" for role, v in (("target", t), ("drafter", d)) if v is not None]
    return [f"memory per rank (peak): {', '.join(shown)}"]


def _default_lines(work: dict | None) -> list[str]:
    """Where the default split comes from: the roles' model FLOPs per token, when known."""
    return [f"default split from {RoleWork(**work).figures()}"] if work else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer plan",
        description=__doc__.split("\n")[0],
        parents=[config_options()],
    )
    parser.add_argument(
        "--gpus", type=int, default=None, help="GPUs of the node (default: visible)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--steps", type=int, default=5, help="timed batches per role")
    parser.add_argument("--warmup", type=int, default=2, help="untimed batches per role")
    parser.add_argument("--out", default="runs/plan", help="where demo assets go (demo configs)")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        from trainer.setup.runtime import resolve_demo

        config = resolve_demo(config, Path(args.out))
        if config.run.threads:
            torch.set_num_threads(config.run.threads)
        gpus = args.gpus if args.gpus is not None else max(1, torch.cuda.device_count())
        rates = measure_rates(config, warmup=args.warmup, steps=args.steps, out_dir=args.out)
        work = role_work(config)
    except TrainerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    r = report(rates, gpus, work=work)
    print(json.dumps(r, indent=2) if args.json else format_report(r))
    return 0
