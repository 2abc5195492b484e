"""The drafter's rotary embedding, taken from the target's rope settings.

The serving engines build the drafter's RoPE from its `config.json` (`rope_theta`,
`rope_scaling`), over the whole head (`rotary_dim = head_dim`) in the rotate-half (NeoX) layout.
So the drafter is trained with the target's theta and scaling, and a setting the engines cannot
express is refused by name (`trainer.export.hf_format.check_target_supported`) instead of trained as
something else.

Types reproduced here (the inverse frequencies equal `transformers`' `ROPE_INIT_FUNCTIONS`,
which the tests check): `default`, `linear` (positions divided by `factor`) and `llama3` (Llama
3.1's per-frequency smoothing). Others (`dynamic`, which depends on the sequence length at
serving time; `yarn`, `longrope`, with their attention factors) are refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads lazily: `trainer.commands.check` reads rope settings without it
    import torch
    from torch import Tensor

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True, kw_only=True)
class RopeSpec:
    """Theta, type and the scaling parameters of that type (empty for `default`)."""

    theta: float = 10000.0
    rope_type: str = "default"
    params: tuple[tuple[str, float], ...] = ()

    def param(self, name: str) -> float:
        return dict(self.params)[name]

    def scaling_dict(self) -> dict[str, Any] | None:
        """`rope_scaling` as the engines read it (None for plain RoPE)."""
        if self.rope_type == "default":
            return None
        return {"rope_type": self.rope_type, **dict(self.params)}

    def parameters_dict(self) -> dict[str, Any]:
        """`rope_parameters` as transformers 5 writes it: theta, type and the scaling keys."""
        return {"rope_theta": self.theta, "rope_type": self.rope_type, **dict(self.params)}


def rope_settings(config: Any) -> dict[str, Any]:
    """A target config's rope settings as one flat dict (`rope_type`, `rope_theta`, scaling
    keys), whether they are stored as transformers 5's `rope_parameters` or as the older
    `rope_theta` + `rope_scaling` (whose type key may be `type`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = dict(getattr(config, "rope_scaling", None) or {})
    merged = {**scaling, **params}
    if "type" in merged and "rope_type" not in merged:
        merged["rope_type"] = merged.pop("type")
    merged.pop("type", None)
    merged.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    merged.setdefault("rope_type", "default")
    return merged


def inv_freq(spec: RopeSpec, head_dim: int, device: torch.device | None = None) -> Tensor:
    """(head_dim/2,) fp32 inverse frequencies of `spec`."""
    import torch

    base = 1.0 / spec.theta ** (
        torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim
    )
    if spec.rope_type == "default":
        return base
    if spec.rope_type == "linear":
        return base / spec.param("factor")
    if spec.rope_type == "llama3":
        return _llama3(base, spec)
    raise ValueError(f"rope type {spec.rope_type!r} is not one of {SUPPORTED_ROPE_TYPES}")


def _llama3(base: Tensor, spec: RopeSpec) -> Tensor:
    """Llama 3.1: long wavelengths divided by `factor`, short ones kept, a smooth blend between."""
    import torch

    factor = spec.param("factor")
    low, high = spec.param("low_freq_factor"), spec.param("high_freq_factor")
    old_len = spec.param("original_max_position_embeddings")
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > old_len / low, base / factor, base)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def rope_cos_sin(positions: Tensor, head_dim: int, spec: RopeSpec) -> tuple[Tensor, Tensor]:
    """positions (Bsz, L) → cos, sin (Bsz, 1, L, hd) in fp32 (rotate-half layout)."""
    import torch

    freqs = positions.float()[..., None] * inv_freq(
        spec, head_dim, positions.device
    )  # (Bsz, L, hd/2)
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # (Bsz, 1, L, hd)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    import torch

    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)
