"""Which targets the served drafter can follow, and the rope it takes from them.

The engines' DFlash drafter (SGLang, vLLM, the DFlash authors' `DFlashDraftModel`; see
docs/serving.md) is a Qwen3-style layer stack: per-head q/k RMSNorm, one `attention_bias` for
q, k, v and o, a SiLU MLP without bias, RoPE over the whole head. A target setting such a
drafter cannot follow is refused here by name, before anything loads, instead of being trained
as something else without a word. `trainer.commands.check` (pre-flight) and `shape_from_target` call
`check_target_supported`.

The drafter's rope is its own: its queries and keys (the context's too) are its own projections,
so it need not rotate as the target does. It takes the target's theta and scaling and always
rotates the whole head, which is what the engines build from the exported config; a target
that rotates part of each head (`partial_rotary_factor`, as Qwen3.5) is followed in everything
else.
"""

from __future__ import annotations

from typing import Any

from trainer.base.errors import UnsupportedTarget
from trainer.model.rope import LLAMA3_KEYS, SUPPORTED_ROPE_TYPES, RopeSpec, rope_settings

_SCALING_KEYS: dict[str, tuple[str, ...]] = {"linear": ("factor",), "llama3": LLAMA3_KEYS}


def check_target_supported(target_config: Any) -> None:
    """Raise `UnsupportedTarget` naming the field and value the served drafter cannot follow:
    a non-SiLU activation, an MLP bias, a rope type not reproduced, kv heads that do not divide
    the heads. Reads the config only (its decoder's part, for a multimodal one)."""
    c = decoder_config(target_config)
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if getattr(c, key, None) is None:
            raise UnsupportedTarget(key, None, "missing; the drafter's shape is taken from it")
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedTarget(
            "hidden_act",
            act,
            "SGLang and vLLM build the DFlash drafter's MLP with SiLU only (they refuse others)",
        )
    if getattr(c, "mlp_bias", False):
        raise UnsupportedTarget(
            "mlp_bias", True, "the engines' DFlash MLP has no bias: they would not load one"
        )
    rope = rope_settings(c)
    kind = rope["rope_type"]
    if kind not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedTarget(
            "rope_scaling.rope_type",
            kind,
            f"the drafter reproduces rope types {', '.join(SUPPORTED_ROPE_TYPES)} only",
        )
    missing = [k for k in _SCALING_KEYS.get(kind, ()) if rope.get(k) is None]
    if missing:
        raise UnsupportedTarget(f"rope_scaling.{missing[0]}", None, f"required by rope type {kind}")
    heads = int(c.num_attention_heads)
    kv = int(getattr(c, "num_key_value_heads", None) or heads)
    if heads % kv:
        raise UnsupportedTarget("num_key_value_heads", kv, f"must divide {heads} attention heads")


def decoder_config(config: Any) -> Any:
    """The language model's part of a `transformers` config: a multimodal one (Qwen3.5's, say)
    keeps it as `text_config`; a plain causal LM's is the config itself."""
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if callable(get) else config


def rope_from_target(target_config: Any) -> RopeSpec:
    """The target's theta, rope type and that type's scaling keys (call
    `check_target_supported` first)."""
    rope = rope_settings(decoder_config(target_config))
    kind = rope["rope_type"]
    return RopeSpec(
        theta=float(rope["rope_theta"]),
        rope_type=kind,
        params=tuple((k, float(rope[k])) for k in _SCALING_KEYS.get(kind, ())),
    )
