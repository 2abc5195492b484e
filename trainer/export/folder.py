"""Export a trained drafter as the Hugging Face folder SGLang, vLLM and the reference load.

    python -m trainer export --config train.toml --checkpoint runs/demo --out drafter/ [--dtype bf16]

`--checkpoint` is a `step-XXXXXXXX` folder or a run folder (then its newest verified
checkpoint; default `$DFLASH_CHECKPOINTS`). Only the target's `config.json` is read (never its
weights). The folder (`config.json`, `model.safetensors`; `trainer.export.hf_format`) is written next to
`--out` and renamed into place. Refused, with the reason and the fix: a checkpoint of other
`model.*` settings than the config's, a target the served drafter cannot follow
(`UnsupportedTarget`), and a checkpoint of an earlier drafter format that the engines would run
differently than it was trained. Then it prints the folder and the SGLang and vLLM command lines
that serve it as trained (`trainer.export.serving`: K = B − 1); docs/serving.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch

from trainer.base.errors import TrainerError
from trainer.export.hf_format import DTYPES, hf_config, hf_tensors, write_folder
from trainer.export.serving import describe
from trainer.model import checkpoint as ckpt
from trainer.model.drafter import DRAFTER_FORMAT, DrafterShape, shape_from_target
from trainer.model.fidelity import decoder_config
from trainer.model.target import default_target_layers
from trainer.settings.config import TrainConfig, diff_settings
from trainer.settings.loading import config_options

log = logging.getLogger(__name__)


class ExportRefused(TrainerError):
    """The drafter cannot be exported as one the engines would run as trained."""


def resolve_checkpoint(path: str | Path) -> tuple[Path, ckpt.Manifest]:
    """A verified `step-…` folder, or the newest verified checkpoint of a run folder."""
    path = Path(path)
    if (path / ckpt.STATE).is_file():
        manifest, why = ckpt.verify(path)
        if manifest is None:
            raise ExportRefused(f"{path}: {why}", hint="Pick another step-… folder.")
        return path, manifest
    found = ckpt.find_resumable(path)
    if found.path is None or found.manifest is None:
        raise ExportRefused(
            f"{path}: no verified checkpoint",
            hint="Pass a step-XXXXXXXX folder or the run folder training wrote to.",
        )
    return found.path, found.manifest


def check_same_model(path: Path, manifest: ckpt.Manifest, config: TrainConfig) -> None:
    """The checkpoint's `model.*` settings must be the config's (the target may have moved)."""
    wanted = {k: v for k, v in config.model_data_settings().items() if k.startswith("model.")}
    saved = {k: v for k, v in manifest.settings.items() if k.startswith("model.")}
    changed = [k for k in diff_settings(saved, wanted) if k != "model.target"]
    if changed:
        raise ExportRefused(
            f"{path} was trained with other settings: {', '.join(changed)}",
            hint="Export with the config the run was trained with (the release's train.toml).",
        )


def served_differently(shape: DrafterShape, state: dict[str, Any]) -> list[str]:
    """How the engines would run a format-1 drafter differently than it was trained."""
    why = []
    if shape.sliding_layers:
        why.append(
            "its sliding-window layers let every slot see [anchor − W, anchor); the engines "
            "give slot k [anchor + k − (W − 1), anchor + k], causal in the block"
        )
    if "layers.0.self_attn.q_norm.weight" not in state:
        why.append("it has no per-head q/k norm (non-Qwen3 target); the engines always apply one")
    if shape.attention_bias:
        why.append("its o_proj has no bias; with attention_bias the engines add one")
    if shape.rope.rope_type != "default":
        why.append(
            f"it was trained with plain RoPE; the target's {shape.rope.rope_type} scaling would be served"
        )
    return why


def target_config(config: TrainConfig) -> Any:
    from transformers import AutoConfig

    folder = Path(config.model.target)
    if not (folder / "config.json").is_file():
        raise ExportRefused(
            f"model.target: {folder} has no config.json",
            hint="Export where the target is (dflash export runs at the place), or set model.target.",
        )
    return decoder_config(AutoConfig.from_pretrained(str(folder), local_files_only=True))


def export(
    config: TrainConfig, checkpoint: str | Path, out: str | Path, *, dtype: str = "bf16"
) -> Path:
    """Write the drafter of `checkpoint` as a Hugging Face folder at `out`; returns `out`."""
    out = Path(out)
    if out.exists():
        raise ExportRefused(f"{out} exists", hint="Choose a new --out, or remove that folder.")
    path, manifest = resolve_checkpoint(checkpoint)
    check_same_model(path, manifest, config)
    tcfg = target_config(config)
    layers = config.model.target_layers or default_target_layers(
        int(tcfg.num_hidden_layers), config.model.num_target_layers
    )
    shape = shape_from_target(tcfg, config.model, num_features=len(layers))
    state = ckpt.load_state(path)["worker"]["drafter"]
    if manifest.drafter_format < DRAFTER_FORMAT:
        why = served_differently(shape, state)
        if why:
            raise ExportRefused(
                f"{path.name} was trained by an earlier trainer (drafter format "
                f"{manifest.drafter_format}) and would be served differently: {'; '.join(why)}",
                hint="Train it again with this version (dflash deploy, without --resume).",
            )
    tensors = hf_tensors(shape, state, DTYPES[dtype])
    cfg = hf_config(
        shape,
        target_layer_ids=layers,
        num_target_layers=int(tcfg.num_hidden_layers),
        max_position_embeddings=int(getattr(tcfg, "max_position_embeddings", 0) or 0),
        dtype=DTYPES[dtype],
        provenance={
            "step": manifest.step,
            "checkpoint": path.name,
            "code_version": manifest.code_version,
        },
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_folder(out, tensors, cfg)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainer export",
        description=__doc__.split("\n")[0],
        parents=[config_options()],
    )
    p.add_argument(
        "--checkpoint",
        default=os.environ.get("DFLASH_CHECKPOINTS"),
        help="a step-XXXXXXXX folder or a run folder (default: $DFLASH_CHECKPOINTS)",
    )
    p.add_argument("--out", required=True, help="the folder to create (must not exist)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr, force=True)
    try:
        from trainer.settings.loading import load_config
        from trainer.setup.runtime import demo_of_checkpoint

        if not args.checkpoint:
            raise ExportRefused("no checkpoint given", hint="Pass --checkpoint DIR.")
        config = load_config(args.config, args.overrides)
        ckpt_path = Path(args.checkpoint)
        config = demo_of_checkpoint(config, ckpt_path)
        torch.set_num_threads(max(1, config.run.threads or torch.get_num_threads()))
        out = export(config, ckpt_path, args.out, dtype=args.dtype)
    except TrainerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(out)
    print(describe(out, str(config.model.target)))
    return 0
