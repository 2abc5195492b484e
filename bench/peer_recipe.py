"""The comparison's recipe as each trainer takes it: ours' `TrainConfig` (the evaluation
benchmark's drafter settings, `bench_eval.drafter_config`), the drafter's architecture as
`config.json` (what ours exports and SpecForge's draft model is built from: the same shapes,
target layers and mask token), and SpecForge's run config for `specforge train`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from bench.peer_common import Settings, epochs_needed, training_data


def ours_config(settings: Settings, *, steps: int | None = None) -> Any:
    """Ours' `TrainConfig`: `bench_eval`'s drafter recipe at these settings, with the schedule
    SpecForge can also run (cosine to 0 after `warmup` steps), no τ probe while training (its
    trainer has none) and the settings' logging window."""
    from bench.bench_eval import drafter_config

    args = argparse.Namespace(
        drafter_layers=settings.drafter_layers, block_size=settings.block_size,
        feature_layers=None, drafter_batch=settings.batch, prompt_len=settings.prompt_len,
        gen_len=settings.gen_len, anchors=settings.anchors, drafter_lr=settings.lr,
        kl_weight=settings.kl_weight, smoke=settings.smoke,
        max_new_tokens=settings.max_new_tokens, lookup_max_n=settings.lookup_max_n,
        overrides=[
            "optim.min_lr_ratio=0", f"optim.warmup_steps={settings.warmup}", "eval.every=0",
            f"run.log_every={settings.log_every}", "run.tensorboard=false",
        ],
    )  # fmt: skip
    device = torch.device(settings.device)
    return drafter_config(
        args, settings.root, training_data(settings), device, steps or settings.steps
    )


def target_layers(settings: Settings) -> list[int]:
    """The target layers ours reads (its default for this target): SpecForge reads the same."""
    from transformers import AutoConfig

    from trainer.model.target import default_target_layers

    model = ours_config(settings).model
    if model.target_layers:
        return list(model.target_layers)
    tcfg = AutoConfig.from_pretrained(str(settings.root / "target"), local_files_only=True)
    return default_target_layers(int(tcfg.num_hidden_layers), model.num_target_layers)


def drafter_shape(settings: Settings) -> Any:
    """The drafter both trainers train here (`trainer.model.drafter.DrafterShape`)."""
    from transformers import AutoConfig

    from trainer.model.drafter import shape_from_target

    tcfg = AutoConfig.from_pretrained(str(settings.root / "target"), local_files_only=True)
    model = ours_config(settings).model
    return shape_from_target(tcfg, model, num_features=len(target_layers(settings)))


def draft_config(settings: Settings) -> dict[str, Any]:
    """The drafter's `config.json` for this comparison's target (`architecture`)."""
    from transformers import AutoConfig

    tcfg = AutoConfig.from_pretrained(str(settings.root / "target"), local_files_only=True)
    model = ours_config(settings).model
    return architecture(tcfg, model, target_layers(settings), dtype(settings))


def architecture(target_config: Any, model: Any, layers: list[int], weights: torch.dtype) -> dict:
    """The drafter's `config.json` as ours' exporter writes it (`trainer.export.hf_format.hf_config`
    for a target config and ours' `model.*` settings), without ours' provenance key:
    SpecForge builds its `DFlashDraftModel` from it."""
    from trainer.export.hf_format import hf_config
    from trainer.model.drafter import shape_from_target
    from trainer.model.fidelity import decoder_config

    tcfg = decoder_config(target_config)
    shape = shape_from_target(tcfg, model, num_features=len(layers))
    cfg = hf_config(
        shape, target_layer_ids=list(layers), num_target_layers=int(tcfg.num_hidden_layers),
        max_position_embeddings=int(tcfg.max_position_embeddings), dtype=weights,
    )  # fmt: skip
    cfg.pop("dflash_trainer")
    return cfg


def dtype(settings: Settings) -> torch.dtype:
    """bf16 on the GPU (both trainers' mixed precision), fp32 on the CPU (the smoke run)."""
    return torch.bfloat16 if settings.device == "cuda" else torch.float32


def specforge_run(
    settings: Settings, *, features: Path, draft: Path, out: Path, sharding: str, samples: int
) -> dict[str, Any]:
    """`specforge train`'s config: offline features (`data.hidden_states_path`: its training
    path without an SGLang server), the same steps, batch, anchors, block, learning rate,
    warmup and cosine decay to 0, the same slot decay γ and mask token; its own defaults
    elsewhere (AdamW betas, no weight decay, gradient clip 0.5, no noise, no KL term)."""
    mask_id = json.loads(draft.read_text())["dflash_config"]["mask_token_id"]
    training: dict[str, Any] = {
        "strategy": "dflash",
        "batch_size": settings.batch,
        "max_steps": settings.steps,
        "total_steps": settings.steps,
        "num_epochs": epochs_needed(settings.steps, settings.batch, samples),
        "learning_rate": settings.lr,
        "lr_scheduler": "cosine",
        "warmup_ratio": (settings.warmup + 0.5) / settings.steps,  # int(ratio · steps) = warmup
        "attention_backend": "flex_attention" if settings.device == "cuda" else "sdpa",
        "num_anchors": settings.anchors,
        "loss_decay_gamma": settings.gamma,
        "log_interval": settings.log_every,
        "fsdp_sharding": sharding,
        "seed": 0,
    }
    data: dict[str, Any] = {"hidden_states_path": str(features), "max_length": settings.max_len}
    if settings.specforge_workers is not None:
        data["dataloader_num_workers"] = settings.specforge_workers
    return {
        "model": {
            "target_model_path": str(settings.root / "target"),
            "draft_model_config": str(draft),
            "torch_dtype": "bfloat16" if settings.device == "cuda" else "float32",
            "mask_token_id": mask_id,
        },
        "data": data,
        "training": training,
        "run_id": "peer",
        "output_dir": str(out),
    }


def usable_samples(settings: Settings) -> list[Any]:
    """The training samples both trainers can use (two consecutive supervised tokens: where
    either may start a block), in the order they were generated."""
    from trainer.data.dataset import anchor_candidates, load_samples

    samples = load_samples(training_data(settings), max_len=settings.max_len)
    return [s for s in samples if anchor_candidates(s.loss_mask).numel()]
