"""The drafter as a Hugging Face folder the serving engines load, both directions.

One mapping between a `DrafterShape` + state dict and `config.json` + `model.safetensors`,
used by the exporter (`trainer.export.folder`) and by the evaluator's `--drafter` loader, so what is
measured is what is served. The names and keys are the ones the engines read (docs/serving.md
says which engine version reads which):

- tensors: `fc`, `hidden_norm`, `norm`, `layers.N.{input_layernorm, post_attention_layernorm}`,
  `layers.N.self_attn.{q,k,v,o}_proj` (bias with `attention_bias`), `layers.N.self_attn.{q,k}_norm`,
  `layers.N.mlp.{gate,up,down}_proj`; no embedding or lm_head (the engines take the target's).
  The drafter's own parameter names are these names: the mapping is checked, not renamed.
- `config.json`: a Qwen3 config with `architectures = ["DFlashDraftModel"]` and every value the
  engines read written explicitly (their fallbacks differ: rope_theta 1e6 in one, guessed target
  layers in another), plus `dflash_trainer` (format, step, source), which the engines ignore.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from trainer.base.errors import TrainerError
from trainer.base.files import fsync_path
from trainer.model.drafter import DRAFTER_FORMAT, Drafter, DrafterShape
from trainer.model.rope import RopeSpec, rope_settings

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
ARCHITECTURE = "DFlashDraftModel"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class DrafterFolderError(TrainerError):
    """A drafter folder is missing a file or key, or says something this trainer cannot run."""

    hint = "Pass a folder written by `python -m trainer export` (or `dflash export`)."


def tensor_names(shape: DrafterShape) -> list[str]:
    """The tensors a drafter of `shape` has, by name (built on the meta device: no memory)."""
    with torch.device("meta"):
        return sorted(Drafter(shape).state_dict())


def hf_config(
    shape: DrafterShape,
    *,
    target_layer_ids: list[int],
    num_target_layers: int,
    max_position_embeddings: int,
    dtype: torch.dtype,
    provenance: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`config.json` for a drafter of `shape`: every key an engine reads, explicitly."""
    if len(target_layer_ids) != shape.num_features:
        raise ValueError(f"{len(target_layer_ids)} target layers for {shape.num_features} features")
    sliding = bool(shape.sliding_layers)
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": shape.hidden_size,
        "num_attention_heads": shape.num_heads,
        "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "rms_norm_eps": shape.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": shape.attention_bias,
        "attention_dropout": 0.0,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": max_position_embeddings,
        "rope_theta": shape.rope.theta,
        "rope_scaling": shape.rope.scaling_dict(),
        "rope_parameters": shape.rope.parameters_dict(),
        "is_neox_style": True,
        "num_hidden_layers": shape.num_layers,
        "num_target_layers": num_target_layers,
        "block_size": shape.block_size,
        "layer_types": shape.layer_types,
        "sliding_window": shape.sliding_window if sliding else None,
        "use_sliding_window": sliding,
        "tie_word_embeddings": False,
        "dflash_config": {
            "target_layer_ids": list(target_layer_ids),
            "mask_token_id": shape.mask_token_id,
        },
        # vLLM before it read dflash_config took only this key (else 3 guessed layers); its
        # aux layer i + 1 is the output of decoder layer i
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in target_layer_ids],
        "dtype": _DTYPE_NAMES[dtype],
        "torch_dtype": _DTYPE_NAMES[dtype],
        "dflash_trainer": {"drafter_format": DRAFTER_FORMAT, **(provenance or {})},
    }


def _need(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise DrafterFolderError(f"{CONFIG} has no {key!r}")
    return cfg[key]


def shape_from_hf_config(cfg: dict[str, Any]) -> DrafterShape:
    """The inverse of `hf_config`: the drafter a `config.json` describes."""
    if _need(cfg, "architectures") != [ARCHITECTURE]:
        raise DrafterFolderError(f"{CONFIG}: architectures is {cfg['architectures']!r}")
    if _need(cfg, "hidden_act") != "silu":
        raise DrafterFolderError(f"{CONFIG}: hidden_act {cfg['hidden_act']!r} is not silu")
    dflash = _need(cfg, "dflash_config")
    layer_types = list(_need(cfg, "layer_types"))
    bad = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
    if bad or len(layer_types) != _need(cfg, "num_hidden_layers"):
        raise DrafterFolderError(f"{CONFIG}: layer_types {layer_types} do not match the layers")
    sliding = tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
    if sliding and not isinstance(cfg.get("sliding_window"), int):
        raise DrafterFolderError(f"{CONFIG}: sliding layers {list(sliding)} need a sliding_window")
    rope = rope_settings(SimpleNamespace(**cfg))
    return DrafterShape(
        hidden_size=int(_need(cfg, "hidden_size")),
        num_heads=int(_need(cfg, "num_attention_heads")),
        num_kv_heads=int(_need(cfg, "num_key_value_heads")),
        head_dim=int(_need(cfg, "head_dim")),
        intermediate_size=int(_need(cfg, "intermediate_size")),
        rms_norm_eps=float(_need(cfg, "rms_norm_eps")),
        attention_bias=bool(_need(cfg, "attention_bias")),
        num_layers=len(layer_types),
        num_features=len(_need(dflash, "target_layer_ids")),
        block_size=int(_need(cfg, "block_size")),
        mask_token_id=int(_need(dflash, "mask_token_id")),
        vocab_size=int(_need(cfg, "vocab_size")),
        sliding_window=int(_need(cfg, "sliding_window")) if sliding else None,
        sliding_layers=sliding,
        rope=RopeSpec(
            theta=float(rope["rope_theta"]),
            rope_type=rope["rope_type"],
            params=tuple(
                (k, float(v)) for k, v in rope.items() if k not in ("rope_theta", "rope_type")
            ),
        ),
    )


def hf_tensors(
    shape: DrafterShape, state: dict[str, Tensor], dtype: torch.dtype
) -> dict[str, Tensor]:
    """The state dict under the engines' names, in `dtype`; refuses a missing or extra tensor
    (at least one engine skips unknown names silently and serves a different function)."""
    want = tensor_names(shape)
    missing = sorted(set(want) - set(state))
    extra = sorted(set(state) - set(want))
    if missing or extra:
        raise DrafterFolderError(
            f"the drafter's tensors do not match its shape: missing {missing[:4]}, extra {extra[:4]}",
            hint="The checkpoint and the config describe different drafters; export with the "
            "config the run was trained with.",
        )
    return {name: state[name].detach().to("cpu", dtype).contiguous() for name in want}


def write_folder(out: Path, tensors: dict[str, Tensor], config: dict[str, Any]) -> Path:
    """Write `config.json` + `model.safetensors` into a temporary folder next to `out`, fsync,
    then rename it to `out`: an interrupted export leaves nothing at `out`."""
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "pt"})
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (tmp / WEIGHTS).chmod(0o644)  # safetensors creates it owner-only; engines may run as others
        for name in (WEIGHTS, CONFIG):
            fsync_path(tmp / name)
        fsync_path(tmp)
        os.rename(tmp, out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_config(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / CONFIG
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise DrafterFolderError(f"{path} does not exist") from exc
    except json.JSONDecodeError as exc:
        raise DrafterFolderError(f"{path} is not JSON: {exc}") from exc


def load_folder(
    folder: str | Path, *, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[Drafter, dict[str, Any]]:
    """A drafter from `config.json` + `model.safetensors` only (no training checkpoint), in
    `dtype` on `device`, and its config. Every tensor must be present, none extra."""
    from safetensors.torch import load_file

    cfg = read_config(folder)
    shape = shape_from_hf_config(cfg)
    weights = Path(folder) / WEIGHTS
    if not weights.is_file():
        raise DrafterFolderError(f"{weights} does not exist")
    state = hf_tensors(shape, load_file(str(weights)), dtype)
    drafter = Drafter(shape).to(dtype)
    drafter.load_state_dict(state)
    return drafter.to(device).eval(), cfg


def load_for_target(folder: str | Path, config: Any) -> tuple[Any, Drafter, int]:
    """(target, drafter, step) for evaluating an exported folder: the target of `config`
    (`model.target`, `run.device`) with the folder's own `target_layer_ids`; the folder must
    have been exported for a target of this vocabulary and width."""
    from trainer.model.target import load_target
    from trainer.setup.runtime import resolve_device

    cfg = read_config(folder)
    layers = list(_need(_need(cfg, "dflash_config"), "target_layer_ids"))
    target = load_target(
        config.model.target, device=resolve_device(config.run.device), layers=layers
    )
    for key in ("vocab_size", "hidden_size"):
        if int(getattr(target.config, key)) != int(cfg[key]):
            raise DrafterFolderError(
                f"{folder}: {key} {cfg[key]} differs from the target's {getattr(target.config, key)}",
                hint="Evaluate it against the target it was exported for (model.target).",
            )
    drafter, _ = load_folder(folder, device=target.device)
    step = int(cfg.get("dflash_trainer", {}).get("step", -1))
    return target, drafter, step
