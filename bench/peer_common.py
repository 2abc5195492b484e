"""What every stage of `bench/compare_peer.py` shares: the comparison's settings (one JSON file
the stages read), where each stage keeps its result, steady-state rates and model FLOPs.

The stages run as separate processes (their peak memory is their own, and SpecForge's packages
are on the path of its stages only); each writes `<work>/stages/<name>.json`.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

GIB = float(1 << 30)
PEAK_BF16 = 989e12  # H200 dense bf16, as the other benchmarks count MFU


@dataclass(frozen=True, kw_only=True)
class Settings:
    """One comparison: the same data, shapes, schedule and steps for both trainers."""

    work: str
    device: str  # "cuda" or "cpu"
    smoke: bool
    steps: int
    batch: int  # sequences per optimizer step
    block_size: int
    drafter_layers: int
    anchors: int  # blocks per sequence
    lr: float
    warmup: int  # steps of linear warmup, then cosine to 0 (SpecForge's only decay)
    kl_weight: float  # ours' loss.kl_weight (SpecForge's DFlash loss has no KL term)
    prompt_len: int
    gen_len: int
    log_every: int  # both trainers' logging window (steady state is measured from them)
    warm_steps: int  # steps left out of the steady state (compiles, allocator warm-up)
    eval_prompts: int
    max_new_tokens: int
    lookup_max_n: int
    reference_prompts: int  # prompts decoded by z-lab's reference loop (first of the held-out)
    reference_seconds: float  # the reference loop stops starting prompts after this
    step_timed: int  # timed drafter steps of the 8B-shaped row
    peer_site: str | None  # packages SpecForge needs (pip install --target); None: on the path
    reference: str | None  # z-lab's `dflash/model.py`, carried as a file; None: not here
    specforge_sharding: str  # training.fsdp_sharding
    specforge_workers: int | None  # data.dataloader_num_workers (None: its default)

    @property
    def max_len(self) -> int:
        return self.prompt_len + self.gen_len

    @property
    def gamma(self) -> float:
        """The slot decay both losses use: ours' default for this block size."""
        from trainer.settings.config import LossConfig

        return LossConfig().resolved_gamma(self.block_size)

    @property
    def root(self) -> Path:
        return Path(self.work)

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> Settings:
        raw = json.loads(Path(path).read_text())
        return cls(**{f.name: raw[f.name] for f in fields(cls)})


# ---- where things are ------------------------------------------------------------------------


def stage_path(settings: Settings, name: str) -> Path:
    return settings.root / "stages" / f"{name}.json"


def write_stage(settings: Settings, name: str, result: dict[str, Any]) -> None:
    """The stage's result, one report a line (`bench.records`: kept as it is in a record)."""
    from bench.records import write_json

    path = stage_path(settings, name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")  # a stage stopped mid-write leaves the last whole file
    write_json(tmp, result)
    tmp.replace(path)


def read_stage(settings: Settings, name: str) -> dict[str, Any] | None:
    path = stage_path(settings, name)
    return json.loads(path.read_text()) if path.is_file() else None


def training_data(settings: Settings) -> Path:
    """The answers `bench_eval.py --prepare-only` generated (its first `trainer.generation.generate` run)."""
    prepared = json.loads((settings.root / "prepare.json").read_text())
    return settings.root / prepared["generation"]["trainer_generate"][0]["data"]


def ours_folder(settings: Settings) -> Path:
    return settings.root / "ours" / "export"


def specforge_folder(settings: Settings) -> Path:
    return settings.root / "specforge" / "export"


# ---- figures ---------------------------------------------------------------------------------


def peak_gib(device: torch.device) -> float | None:
    """This process's peak allocated memory (each stage is its own process)."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / GIB


def steady(windows: list[tuple[int, int, float]], warm_steps: int) -> dict[str, Any] | None:
    """Steady-state seconds per step from logging windows `(first step, last step, seconds)`:
    the windows that start at or after `warm_steps`; None when none does."""
    kept = [(end - start, s) for start, end, s in windows if start >= warm_steps and end > start]
    if not kept:
        return None
    steps = sum(n for n, _ in kept)
    per_window = [s / n for n, s in kept]
    return {
        "step_s": sum(s for _, s in kept) / steps,
        "steps": steps,
        "window_step_s": [min(per_window), max(per_window)],
    }


def rates(step_s: float, batch: int, tokens_per_sample: float, flops_per_sample: float) -> dict:
    """tokens/s, samples/s and MFU (model FLOPs of the drafter ÷ H200 bf16 peak) of a step."""
    samples = batch / step_s
    return {
        "step_s": step_s,
        "samples_per_s": samples,
        "tokens_per_s": samples * tokens_per_sample,
        "mfu": samples * flops_per_sample / PEAK_BF16,
    }


def data_figures(settings: Settings, samples: Any, shape: Any) -> dict[str, float]:
    """Mean real tokens per training sample, and model FLOPs of a drafter step per sample
    (`bench.flops.drafter_step_flops` for the drafter of `shape`: ours with its KL term,
    SpecForge's without), over the first batches of the data as our trainer draws them: both
    trainers draw up to `anchors` blocks a sequence among the same candidates, so the work per
    sample is the same in expectation."""
    from bench.flops import drafter_step_flops
    from trainer.data.dataset import BatchStream
    from trainer.settings.config import DataConfig

    lengths = [len(s.input_ids) for s in samples]
    data = DataConfig(
        path="in-memory", batch_size=settings.batch, max_len=settings.max_len,
        num_anchors=settings.anchors, bucket=32,
    )  # fmt: skip
    stream = BatchStream(samples, data, block_size=settings.block_size, seed=0)
    count = max(1, min(8, len(samples) // settings.batch))
    batches = [stream.next_batch() for _ in range(count)]
    per = settings.batch * count

    def flops(kl: bool) -> float:
        return sum(drafter_step_flops(shape, b, kl=kl) for b in batches) / per

    return {
        "tokens_per_sample": statistics.fmean(lengths),
        "flops_per_sample_ours": flops(True),
        "flops_per_sample_specforge": flops(False),
    }


def epochs_needed(steps: int, batch: int, samples: int) -> int:
    """Passes over `samples` that `steps` batches of `batch` need (and one spare)."""
    return math.ceil(steps * batch / max(1, samples)) + 1
