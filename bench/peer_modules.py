"""SpecForge's DFlash modules driven from this project's side: its draft model
(`DFlashDraftModel`), its training wrapper and loss (`OnlineDFlashModel`: anchors, mask, noise
embedding, chunked CE with the slot decay) and its optimizer (`BF16Optimizer`: fp32 masters of
bf16 weights, AdamW, gradient clipping, warmup then cosine), one step being what its DFlash
strategy does (`DFlashTrainStrategy.forward_loss`, backward, optimizer step) without its
trainer, loader and process group around it.

Used for the 8B-shaped drafter-step row (the same precomputed features for both trainers), and
to train on the comparison's data when its training entry does not run on the machine
(`train`: batches from ours' data loop, features from the same target in this process)."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from bench.common import log
from bench.peer_common import Settings, peak_gib, specforge_folder, steady, write_stage

DEFAULT_CLIP = 0.5  # SpecForge's training.max_grad_norm default


def wrapper(
    draft: Path,
    *,
    embed_weight: torch.Tensor,
    lm_head_weight: torch.Tensor,
    backend: str,
    num_anchors: int,
    gamma: float,
    weights: torch.dtype,
) -> Any:
    """Its `OnlineDFlashModel` around a new `DFlashDraftModel` of the config file `draft` (read
    and built as its `build_dflash_draft` does), with the target's frozen embedding and
    lm_head."""
    from specforge.algorithms.common.dflash_family_model import OnlineDFlashModel
    from specforge.modeling.auto import AutoDraftModel
    from specforge.training.model_loading import load_draft_config_source

    config = load_draft_config_source(str(draft))
    config._attn_implementation = backend
    device = embed_weight.device
    model = AutoDraftModel.from_config(config, torch_dtype=weights).to(device)
    embed = nn.Embedding.from_pretrained(embed_weight.detach().to(weights), freeze=True)
    head = nn.Linear(lm_head_weight.shape[1], lm_head_weight.shape[0], bias=False)
    head.weight = nn.Parameter(lm_head_weight.detach().to(weights), requires_grad=False)
    return OnlineDFlashModel(
        draft_model=model, target_lm_head=head.to(device), target_embed_tokens=embed.to(device),
        mask_token_id=int(config.dflash_config["mask_token_id"]),
        block_size=int(config.block_size), attention_backend=backend,
        num_anchors=num_anchors, loss_decay_gamma=gamma,
    ).to(device)  # fmt: skip


def optimizer(model: Any, *, lr: float, steps: int, warmup: int) -> Any:
    """Its `BF16Optimizer` over the draft model, warmup then cosine to 0 over `steps`."""
    from specforge.optimizer import BF16Optimizer

    return BF16Optimizer(
        model.draft_model, lr=lr, max_grad_norm=DEFAULT_CLIP, total_steps=steps,
        warmup_ratio=(warmup + 0.5) / steps, lr_scheduler="cosine",
    )  # fmt: skip


def step(model: Any, opt: Any, input_ids: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor):
    """One training step as its DFlash strategy takes it → the loss (a device tensor)."""
    loss, _, _ = model(input_ids=input_ids, hidden_states=hidden, loss_mask=mask)
    loss.backward()
    opt.step()
    return loss.detach()


# ---- the 8B-shaped drafter step ------------------------------------------------------------------


def drafter_step(settings: Settings) -> dict[str, Any]:
    """Its step on `bench/peer_ours.step_inputs` (the features ours trains on in its row)."""
    from bench.bench_pipeline import train_config
    from bench.peer_ours import memory_mark, shape_row, step_figures, step_inputs, timed_steps
    from bench.peer_recipe import architecture
    from trainer.model.drafter import shape_from_target

    device = torch.device(settings.device)
    inputs = step_inputs(settings)
    spec, target = inputs["spec"], inputs["target"]
    weights = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_cfg = train_config(spec, Path("in-memory"), device=settings.device, steps=100).model
    draft = settings.root / "specforge" / "draft_config_step.json"
    draft.parent.mkdir(parents=True, exist_ok=True)
    draft.write_text(json.dumps(architecture(target.config, model_cfg, target.layers, weights)))
    base = memory_mark(device)
    torch.manual_seed(0)
    model = wrapper(
        draft, embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight,
        backend=_backend(device), num_anchors=spec["num_anchors"],
        gamma=_gamma(spec["block_size"]), weights=weights,
    )  # fmt: skip
    opt = optimizer(model, lr=3e-4, steps=100, warmup=2)  # bench_pipeline's schedule
    masks = [inputs["mask"].expand_as(b.input_ids).to(device) for b in inputs["batches"]]
    feats = inputs["features"]

    def one(i: int) -> None:
        f = feats[i]
        step(model, opt, f.input_ids, f.hidden.to(weights), masks[i])

    timing = timed_steps(one, inputs, device, base)
    shape = shape_from_target(target.config, model_cfg, num_features=len(target.layers))
    figures = step_figures(timing, inputs, shape, kl=False)
    return {"ok": True, **figures, "backend": _backend(device), "shape": shape_row(spec)}


def _backend(device: torch.device) -> str:
    """Its default attention backend (flex_attention) on the GPU; SDPA on the CPU, where
    FlexAttention has no backward."""
    return "flex_attention" if device.type == "cuda" else "sdpa"


def _gamma(block_size: int) -> float:
    from trainer.settings.config import LossConfig

    return LossConfig().resolved_gamma(block_size)


# ---- training from ours' data loop ---------------------------------------------------------------


class Recorded(Sequence[Any]):
    """The samples, recording which ones a batch was made of (their loss masks are what
    SpecForge's loss takes in place of ours' labels)."""

    def __init__(self, samples: Sequence[Any]) -> None:
        self.samples = samples
        self.taken: list[Any] = []

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: Any) -> Any:
        sample = self.samples[i]
        self.taken.append(sample)
        return sample


def loss_masks(taken: Sequence[Any], shape: torch.Size, device: torch.device) -> torch.Tensor:
    """The batch's samples' loss masks, right-padded as ours pads their tokens → (Bsz, S)."""
    mask = torch.zeros(shape, dtype=torch.long)
    for row, sample in enumerate(taken):
        mask[row, : len(sample.loss_mask)] = torch.tensor(sample.loss_mask, dtype=torch.long)
    return mask.to(device)


def train(settings: Settings, why: str) -> dict[str, Any]:
    """Its modules trained for the comparison's steps on ours' batches (`BatchStream`: the
    same order, anchors aside, as ours draws), the features from the target in this process
    (as ours' own run computes them), windows of `log_every` steps timed; then its
    `save_pretrained` folder (what its exporter writes)."""
    from bench.peer_recipe import draft_config, dtype, ours_config, target_layers, usable_samples
    from trainer.data.dataset import BatchStream
    from trainer.model.target import load_target
    from trainer.run.target_worker import TargetWorker

    device, weights = torch.device(settings.device), dtype(settings)
    config = ours_config(settings)
    samples = Recorded(usable_samples(settings))
    stream = BatchStream(samples, config.data, block_size=settings.block_size, seed=config.run.seed)
    target = load_target(settings.root / "target", device=device, layers=target_layers(settings))
    producer = TargetWorker(target)
    torch.manual_seed(0)
    draft = settings.root / "specforge" / "draft_config.json"
    draft.parent.mkdir(parents=True, exist_ok=True)
    draft.write_text(json.dumps(draft_config(settings), indent=2) + "\n")
    model = wrapper(
        draft, embed_weight=target.embed_weight,
        lm_head_weight=target.lm_head_weight, backend=_backend(device),
        num_anchors=settings.anchors, gamma=settings.gamma, weights=weights,
    )  # fmt: skip
    opt = optimizer(model, lr=settings.lr, steps=settings.steps, warmup=settings.warmup)
    windows: list[tuple[int, int, float]] = []
    started = at = time.perf_counter()
    last = 0
    for i in range(settings.steps):
        samples.taken.clear()
        batch = stream.next_batch()
        mask = loss_masks(samples.taken, batch.input_ids.shape, device)
        f = producer.produce(batch)
        loss = step(model, opt, f.input_ids, f.hidden.to(weights), mask)
        if (i + 1) % settings.log_every == 0 or i + 1 == settings.steps:
            value = float(loss)  # waits for the step, as a logged step does
            now = time.perf_counter()
            windows.append((last, i + 1, now - at))
            last, at = i + 1, now
            log(f"specforge modules: step {i + 1}/{settings.steps} loss {value:.4f}")
    wall = time.perf_counter() - started
    out = specforge_folder(settings)
    shutil.rmtree(out, ignore_errors=True)
    model.draft_model.save_pretrained(str(out))
    return {
        "ok": True,
        "why": why,
        "wall_s": wall,
        "peak_gib": peak_gib(device),
        "steady": steady(windows, settings.warm_steps),
        "folder": str(out),
    }


def stage(settings: Settings, name: str, why: str = "") -> None:
    """The child process of stage `name` (`specforge-modules` or `specforge-step`)."""
    if name == "specforge-modules":
        result = train(settings, why)
        log(f"specforge modules: {result['steady']}")
    else:
        result = drafter_step(settings)
    write_stage(settings, name, result)
