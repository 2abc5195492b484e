"""The DFlash drafter: a few decoder layers shaped like the target's, conditioned on target features.

Forward, for a batch of sequences with N blocks of B slots each:
1. context: the selected target layers' hidden states (Bsz, S, n·H) → `fc` → RMSNorm → (Bsz, S, H);
2. block tokens `[x_anchor, MASK, …, MASK]` embedded with the target's frozen embedding
   → (Bsz, N·B, H);
3. every layer: queries from the block tokens only; keys/values = the same k/v projections applied
   to `[context | block tokens]`, per-head RMSNorm on q and k, RoPE (the target's theta and
   scaling, `trainer.model.rope`) at positions 0…S−1 for the context and anchor+k for slot k;
   the mask (`trainer.model.attention.build_draft_mask`, built once per batch and per layer kind) lets
   block n see context positions < anchor n and its own block only (sliding-window layers: the
   engines' per-slot window, causal inside the block);
4. final RMSNorm → (Bsz, N, B, H), read by the target's frozen lm_head inside the loss.
The drafter has no embedding or lm_head of its own: they are passed in (frozen) at call time.

The layer is the one the serving engines run (docs/serving.md): q/k norms always, one bias for
q, k, v and o, a SiLU MLP without bias; `check_target_supported` (`trainer.model.fidelity`) refuses a
target such a layer cannot follow. `DRAFTER_FORMAT` is recorded with each checkpoint: format-1
drafters (the window counted before the anchor, q/k norms for Qwen3 targets only, no o_proj
bias, plain RoPE) may be served differently, and the exporter refuses those that would be.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from trainer.model.attention import (
    DraftMask,
    build_draft_mask,
    compile_errors_as_typed,
    draft_attention,
    fail_instead_of_eager_fallback,
)
from trainer.model.fidelity import check_target_supported, decoder_config, rope_from_target
from trainer.model.rope import RopeSpec, apply_rope, rope_cos_sin
from trainer.settings.config import ModelConfig, TrainConfigError

__all__ = ["DRAFTER_FORMAT", "Drafter", "DrafterShape", "check_target_supported"]

DRAFTER_FORMAT = 2  # 2: the engines' window rule, q/k norms always, o_proj bias, target rope


@dataclass(frozen=True, kw_only=True)
class DrafterShape:
    """Everything that fixes the drafter's parameter shapes and attention pattern."""

    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool  # one bias on q, k, v and o (the engines' meaning)
    num_layers: int
    num_features: int  # n: target layers concatenated
    block_size: int
    mask_token_id: int
    vocab_size: int  # rows of the target's embedding
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = field(default_factory=tuple)
    sliding_causal: bool = True
    rope: RopeSpec = field(default_factory=RopeSpec)
    qk_norm: bool = True  # False only to load a format-1 checkpoint of a non-Qwen3 target
    o_proj_bias: bool | None = None  # None: attention_bias; False: a format-1 checkpoint

    def __post_init__(self) -> None:
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise TrainConfigError(
                "model.mask_token_id",
                f"{self.mask_token_id} is not a row of the target's embedding (0…{self.vocab_size - 1})",
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"kv heads {self.num_kv_heads} must divide heads {self.num_heads}")

    @property
    def has_o_bias(self) -> bool:
        return self.attention_bias if self.o_proj_bias is None else self.o_proj_bias

    @property
    def layer_types(self) -> list[str]:
        """Per layer, named as the engines' `layer_types` config key names them."""
        return [
            "sliding_attention" if i in self.sliding_layers else "full_attention"
            for i in range(self.num_layers)
        ]


# The drafter's own shape keys, by the parameters whose shapes they change.
def _keys_behind(wrong: list[str]) -> list[str]:
    """The drafter shape keys that make these parameter names differ from the target's: a
    head_dim of its own changes every attention projection (and the q/k norms), so it alone is
    named then; otherwise k/v name num_kv_heads and q/o num_heads."""
    part = {p: any(f".{p}." in n for n in wrong) for p in _PARTS}
    keys = ["model.intermediate_size"] if part["mlp"] else []
    if part["q_norm"] or part["k_norm"] or all(part[p] for p in ("q_proj", "k_proj", "o_proj")):
        return [*keys, "model.head_dim"]
    if part["k_proj"] or part["v_proj"]:
        keys.append("model.num_kv_heads")
    if part["q_proj"] or part["o_proj"]:
        keys.append("model.num_heads")
    return keys


_PARTS = ("mlp", "q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")


def shape_from_target(target_config: Any, model: ModelConfig, *, num_features: int) -> DrafterShape:
    """Take the layer shape, rope and bias from a `transformers` config, the MLP width, the
    heads, key/value heads and head dimension from `model` where set; a target the served
    drafter cannot follow raises `UnsupportedTarget` (`check_target_supported`), key/value
    heads that do not divide the heads `TrainConfigError`."""
    c = decoder_config(target_config)
    check_target_supported(c)
    target_heads = int(c.num_attention_heads)
    target_kv = int(getattr(c, "num_key_value_heads", None) or target_heads)
    heads, kv_heads = model.attention_heads(target_heads, target_kv)
    head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // target_heads)
    vocab = int(c.vocab_size)
    mask_id = model.mask_token_id
    if mask_id is None:
        pad = getattr(c, "pad_token_id", None)
        mask_id = int(pad) if pad is not None else vocab - 1
    return DrafterShape(
        hidden_size=int(c.hidden_size),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=model.head_dim or head_dim,
        intermediate_size=model.intermediate_size or int(c.intermediate_size),
        rms_norm_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        rope=rope_from_target(c),
        attention_bias=bool(getattr(c, "attention_bias", False)),
        num_layers=model.num_layers,
        num_features=num_features,
        block_size=model.block_size,
        mask_token_id=mask_id,
        vocab_size=vocab,
        sliding_window=model.sliding_window,
        sliding_layers=tuple(model.sliding_layers),
        sliding_causal=model.sliding_causal,
    )


def _count(n: int) -> str:
    """1.05 B, 31.5 M, 4,096."""
    if n >= 10**9:
        return f"{n / 1e9:.2f} B"
    return f"{n / 1e6:.1f} M" if n >= 10**6 else f"{n:,}"


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class DrafterAttention(nn.Module):
    def __init__(self, s: DrafterShape) -> None:
        super().__init__()
        self.s = s
        hd, bias = s.head_dim, s.attention_bias
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(s.num_heads * hd, s.hidden_size, bias=s.has_o_bias)
        self.q_norm = RMSNorm(hd, s.rms_norm_eps) if s.qk_norm else nn.Identity()
        self.k_norm = RMSNorm(hd, s.rms_norm_eps) if s.qk_norm else nn.Identity()

    def forward(
        self,
        x: Tensor,
        ctx: Tensor,
        rope_q: tuple[Tensor, Tensor],
        rope_k: tuple[Tensor, Tensor],
        mask: DraftMask,
    ) -> Tensor:
        """x (Bsz, Q, H) block tokens (normed), ctx (Bsz, S, H) projected context → (Bsz, Q, H)."""
        bsz, q_len, _ = x.shape
        hd = self.s.head_dim
        kv_in = torch.cat([ctx, x], dim=1)  # (Bsz, S+Q, H)
        q = self.q_norm(self.q_proj(x).view(bsz, q_len, -1, hd)).transpose(1, 2)  # (Bsz, Hq, Q, hd)
        k = self.k_norm(self.k_proj(kv_in).view(bsz, kv_in.shape[1], -1, hd)).transpose(1, 2)
        v = (
            self.v_proj(kv_in).view(bsz, kv_in.shape[1], -1, hd).transpose(1, 2)
        )  # (Bsz, Hkv, K, hd)
        # under autocast the projections are bf16 but the fp32-weighted q/k norms give fp32:
        # attention needs one dtype
        q = apply_rope(q, *rope_q).to(v.dtype)
        k = apply_rope(k, *rope_k).to(v.dtype)
        out = draft_attention(q, k, v, mask)  # (Bsz, Hq, Q, hd)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, q_len, -1))


class DrafterMLP(nn.Module):
    def __init__(self, s: DrafterShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    """One decoder layer. With `recompute` its training forward keeps only its inputs and runs
    again in the backward (`run.recompute_layers`): the layer's activations (the MLP's
    intermediate products above all) live one layer at a time instead of all layers at once.
    The checkpoint sits inside `forward`, so a compiled layer traces it into its graph."""

    def __init__(self, s: DrafterShape, *, sliding: bool, recompute: bool = False) -> None:
        super().__init__()
        self.sliding = sliding
        self.recompute = recompute
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = DrafterAttention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = DrafterMLP(s)

    def forward(self, x: Tensor, ctx: Tensor, rope_q: Any, rope_k: Any, mask: DraftMask) -> Tensor:
        if not (self.recompute and torch.is_grad_enabled()):
            return self._layer(x, ctx, rope_q, rope_k, mask)

        def again(x: Tensor, ctx: Tensor) -> Tensor:  # the mask and rope travel as closures
            return self._layer(x, ctx, rope_q, rope_k, mask)

        return cast(Tensor, checkpoint(again, x, ctx, use_reentrant=False))

    def _layer(self, x: Tensor, ctx: Tensor, rope_q: Any, rope_k: Any, mask: DraftMask) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_k, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """The DFlash drafter; `forward` returns hidden states (Bsz, N, B, H) after the final norm."""

    def __init__(
        self,
        shape: DrafterShape,
        *,
        attention_backend: str = "auto",
        attention_kernels: str = "auto",
        recompute_layers: bool = False,
    ) -> None:
        super().__init__()
        self.shape = shape
        self.attention_backend = attention_backend
        self.attention_kernels = attention_kernels  # flex kernel options (trainer.model.attention)
        h = shape.hidden_size
        self.fc = nn.Linear(shape.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, shape.rms_norm_eps)
        self.layers = nn.ModuleList(
            DrafterLayer(shape, sliding=i in shape.sliding_layers, recompute=recompute_layers)
            for i in range(shape.num_layers)
        )
        self.norm = RMSNorm(h, shape.rms_norm_eps)
        self.reset_parameters()

    def describe(self) -> str:
        """One line for the run's log: the shape a user chose (layers, MLP width, B) and what it
        costs, so that a run's capacity is on record beside its figures."""
        s = self.shape
        params = sum(p.numel() for p in self.parameters())
        layers = f"{s.num_layers} layer{'s' * (s.num_layers != 1)}"
        inputs = f"{s.num_features} target layer{'s' * (s.num_features != 1)} in"
        heads = f"{s.num_heads} heads ({s.num_kv_heads} kv) × {s.head_dim}"
        recomputed = any(layer.recompute for layer in self.drafter_layers())
        return (
            f"drafter: {layers} × {s.hidden_size}, {heads}, MLP {s.intermediate_size}, "
            f"B = {s.block_size}, {inputs}; {_count(params)} parameters trained (the target's "
            "embedding and lm_head borrowed)"
            + ("; layers recomputed in the backward" if recomputed else "")
        )

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)

    @torch.no_grad()
    def start_from(self, weights: Mapping[str, Tensor]) -> None:
        """Copy a target's layer and final-norm weights into the drafter (`model.init_layers`,
        `Target.starting_weights`): every parameter of the decoder layers and the final norm
        must be given with its shape; `fc` and `hidden_norm`, which read the target's features,
        keep their own start."""
        own = {
            name: p for name, p in self.named_parameters() if name.startswith(("layers.", "norm."))
        }
        missing = sorted(set(own) - set(weights))
        extra = sorted(set(weights) - set(own))
        wrong = [n for n in own if n in weights and weights[n].shape != own[n].shape]
        if missing or extra or wrong:
            own_shape = _keys_behind(wrong)
            why = f" (a {' and '.join(own_shape)} other than the target's)" if own_shape else ""
            raise TrainConfigError(
                "model.init_layers",
                "the target's layers do not fit the drafter's "
                f"(missing {missing[:4]}, unknown {extra[:4]}, other shapes {wrong[:4]}){why}; "
                "remove the key to start from random weights",
            )
        for name, p in own.items():
            p.copy_(weights[name].to(device=p.device, dtype=p.dtype))

    def compile_layers(self, **options: Any) -> None:
        """Compile each decoder layer in place (`nn.Module.compile`: parameter names unchanged).

        Eager, every RMSNorm, RoPE, SwiGLU and residual add is its own pass over fp32 or bf16
        activations, forward and backward; compiled, they fuse into the kernels around the
        matmuls, and the FlexAttention call is traced into the same graph. Layers 1… share one
        compiled graph (modules are inlined, their parameters are inputs); layer 0, whose input
        (the frozen embeddings) needs no gradient, compiles its own. `options` go to
        `torch.compile` (the CPU tests pick a backend that needs no C++ compiler). Past dynamo's
        recompile limit a layer raises `CompileCacheFull`, as the attention kernels do.
        """
        fail_instead_of_eager_fallback()
        for layer in self.layers:
            layer.compile(**options)

    def block_tokens(self, input_ids: Tensor, anchors: Tensor) -> Tensor:
        """`[x_anchor, MASK, …]` → (Bsz, N, B) long."""
        bsz, n = anchors.shape
        first = input_ids.gather(1, anchors)  # (Bsz, N)
        tokens = torch.full(
            (bsz, n, self.shape.block_size),
            self.shape.mask_token_id,
            dtype=torch.long,
            device=input_ids.device,
        )
        tokens[:, :, 0] = first
        return tokens

    def drafter_layers(self) -> list[DrafterLayer]:
        """The layers as what they are (`nn.ModuleList` hands out plain modules)."""
        return [cast(DrafterLayer, layer) for layer in self.layers]

    def build_masks(
        self, anchors: Tensor, valid: Tensor, context_len: int
    ) -> dict[bool, DraftMask]:
        """One mask per layer kind (full / sliding), shared by all layers of that kind."""
        s = self.shape
        kinds = {layer.sliding for layer in self.drafter_layers()}
        return {
            sliding: build_draft_mask(
                anchors,
                valid,
                context_len,
                s.block_size,
                window=s.sliding_window if sliding else None,
                causal_in_block=s.sliding_causal if sliding else False,
                backend=self.attention_backend,
                num_heads=s.num_heads,
                kernel_preset=self.attention_kernels,
            )
            for sliding in sorted(kinds)
        }

    def forward(
        self,
        features: Tensor,
        input_ids: Tensor,
        anchors: Tensor,
        valid: Tensor,
        embed_weight: Tensor,
    ) -> Tensor:
        """features (Bsz, S, n·H), input_ids (Bsz, S), anchors/valid (Bsz, N), embed_weight (V, H)
        → hidden (Bsz, N, B, H)."""
        s = self.shape
        bsz, seq, _ = features.shape
        n = anchors.shape[1]
        anchors = torch.where(valid, anchors, torch.zeros_like(anchors))
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(features.to(dtype)))  # (Bsz, S, H)
        x = F.embedding(self.block_tokens(input_ids, anchors), embed_weight)  # (Bsz, N, B, H)
        x = x.reshape(bsz, n * s.block_size, -1).to(dtype)  # (Bsz, Q, H)
        ctx_pos = torch.arange(seq, device=features.device).expand(bsz, seq)  # (Bsz, S)
        blk_pos = anchors[:, :, None] + torch.arange(s.block_size, device=features.device)
        blk_pos = blk_pos.reshape(bsz, -1)  # (Bsz, Q)
        rope_q = rope_cos_sin(blk_pos, s.head_dim, s.rope)
        rope_k = rope_cos_sin(torch.cat([ctx_pos, blk_pos], dim=1), s.head_dim, s.rope)
        masks = self.build_masks(anchors, valid, seq)
        with compile_errors_as_typed("A drafter layer"):
            for layer in self.drafter_layers():
                x = layer(x, ctx, rope_q, rope_k, masks[layer.sliding])
        return self.norm(x).reshape(bsz, n, s.block_size, -1)  # (Bsz, N, B, H)
