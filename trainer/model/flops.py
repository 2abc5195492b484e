"""Model FLOPs of the drafter's training step and of a target's feature forward: the work the
model needs, not what its kernels happen to do (no backward recomputation, no masked-out scores
inside a computed tile, no padding). The benchmarks divide them by time for MFU (`bench/flops.py`
imports them from here); the trainer compares the two roles' work per token for the default
split of a node (`trainer.split.split_shapes`).

Drafter step (`drafter_step_flops`, counted from the batch itself):
- linear layers, per token they see: 2 forward + 2 for the weight gradient + 2 for the input
  gradient where the input needs one. `fc` sees the real context tokens and its input (the
  target's features) needs none (4×); k/v see context + block tokens, q/o/MLP the block tokens
  of the valid blocks (Q = valid blocks·B); layer 0's q/k/v read the frozen block-token
  embeddings, which need no gradient (4× for those);
- attention: 12·head_dim·heads·P per layer (forward 4: QKᵀ and PV; backward 8), P = the
  (query, key) pairs that layer's mask allows (`trainer.model.masks`) — full layers see the context
  before the anchor and their whole block, sliding-window layers the window and their block
  causally — counted per slot from the anchors, as many as the dense mask holds;
- lm_head and loss with the frozen weight, over the R supervised rows (the loss computes no
  other): 2·R·H·V for the drafter's logits, 2·R·H·V for their input gradient, and with the KL
  term 2·R·H·V for the target's logits.

Target forward (`target_forward_flops`, T tokens of one sequence; the features forward runs no
lm_head):
- matrix multiplies: 2·T per weight of the decoder layers' linear layers (attention with its
  output gate, the linear-attention projections, the MLP), read from the model itself;
- the short causal convolutions: 2·T per weight;
- causal attention in the full-attention layers: 4·head_dim·heads·T(T+1)/2;
- the gated delta rule of the linear-attention layers, as the chunked algorithm computes it
  (chunks of C = 64 tokens, per value head and token): 2·C·(3·d_k + 2·d_v) for the in-chunk
  products (k·kᵀ, the WY factors w and u, q·kᵀ, the in-chunk output), 6·d_k·d_v for reading
  and updating the d_k × d_v state, 2·C²/3 for the triangular solve. The recurrent form would
  count 6·d_k·d_v alone; at these shapes the difference is under 1 % of the forward.
"""

from __future__ import annotations

from typing import Any

import torch

CHUNK = 64  # the gated delta rule's chunk length (transformers' reference and fla's kernels)


def attention_pairs(
    anchors: torch.Tensor,
    valid: torch.Tensor,
    context_len: int,
    block_size: int,
    *,
    window: int | None = None,
    causal_in_block: bool = False,
) -> int:
    """(query, key) pairs a drafter layer's mask allows over a batch: the `True`s of
    `trainer.model.masks.batched_dense_mask`, counted per slot instead of built. Slot k of a valid
    block at anchor a sees the context keys from `lo` to min(a, S) − 1 (lo = 0, with a window W
    a + k − (W − 1)) and the keys of its own block from max(0, k − (W − 1)) to k (causal) or
    B − 1."""
    k = torch.arange(block_size, device=anchors.device)  # (B,)
    a = anchors[..., None]  # (Bsz, N, 1)
    lo = (a + k - (window - 1)).clamp(min=0) if window is not None else torch.zeros_like(a)
    context = (a.clamp(max=context_len) - lo).clamp(min=0)  # (Bsz, N, B) or (Bsz, N, 1)
    last = k if causal_in_block else torch.full_like(k, block_size - 1)
    first = (k - (window - 1)).clamp(min=0) if window is not None else torch.zeros_like(k)
    own = int((last - first + 1).sum())  # its own block's keys, over the slots of one block
    seen = context.expand(*anchors.shape, block_size).sum(-1)  # (Bsz, N)
    return int((seen * valid).sum()) + own * int(valid.sum())


def drafter_step_flops(shape: Any, batch: Any, *, kl: bool = True) -> float:
    """Model FLOPs of one drafter train step of `shape` (a `trainer.model.drafter.DrafterShape` or any
    object with its attributes) on `batch` (a `trainer.data.dataset.Batch`; module docstring)."""
    from trainer.loss.dflash_loss import IGNORE_INDEX

    h, hq, hkv, hd = shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim
    b, v = shape.block_size, shape.vocab_size
    context = int(batch.lengths.sum())  # real context tokens
    q = int(batch.valid.sum()) * b  # rows of the valid blocks
    slot = torch.arange(b, device=batch.labels.device)
    rows = int(((batch.labels != IGNORE_INDEX) & (slot >= 1)).sum())  # supervised rows
    q_w, o_w, kv_w = h * hq * hd, hq * hd * h, 2 * h * hkv * hd
    mlp_w = 3 * h * shape.intermediate_size
    fc = 4 * (shape.num_features * h * h) * context
    per_layer = 6 * (q_w + o_w + mlp_w) * q + 6 * kv_w * (context + q)
    first_layer_frozen_inputs = 2 * (q_w + kv_w) * q  # no input gradient into the embeddings
    pairs: dict[int | None, int] = {}
    attn = 0
    for i in range(shape.num_layers):
        window = shape.sliding_window if i in shape.sliding_layers else None
        if window not in pairs:
            pairs[window] = attention_pairs(
                batch.anchors,
                batch.valid,
                batch.input_ids.shape[1],
                b,
                window=window,
                causal_in_block=window is not None and shape.sliding_causal,
            )
        attn += 12 * hd * hq * pairs[window]
    head = (3 if kl else 2) * 2 * rows * h * v
    return float(fc + shape.num_layers * per_layer - first_layer_frozen_inputs + attn + head)


def delta_rule_flops_per_token(d_k: int, d_v: int, chunk: int = CHUNK) -> float:
    """FLOPs of the chunked gated delta rule per value head and token (module docstring)."""
    return 2 * chunk * (3 * d_k + 2 * d_v) + 6 * d_k * d_v + 2 * chunk**2 / 3


def target_forward_flops(model: Any, tokens: int) -> dict[str, float]:
    """Model FLOPs of a `transformers` causal LM's decoder stack over one sequence of `tokens`,
    by kind (module docstring); `total` is their sum."""
    base = getattr(model, model.base_model_prefix)
    c = model.config
    linear = conv = 0
    for module in base.layers.modules():
        if isinstance(module, torch.nn.Linear):
            linear += module.weight.numel()
        elif isinstance(module, torch.nn.Conv1d):
            conv += module.weight.numel()
    types = list(getattr(c, "layer_types", None) or ["full_attention"] * c.num_hidden_layers)
    full = types.count("full_attention")
    gdn = types.count("linear_attention")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    out = {
        "matmul": 2.0 * tokens * linear,
        "conv": 2.0 * tokens * conv,
        "attention": 4.0 * head_dim * c.num_attention_heads * tokens * (tokens + 1) / 2 * full,
        "delta_rule": 0.0,
    }
    if gdn:
        per_token = delta_rule_flops_per_token(c.linear_key_head_dim, c.linear_value_head_dim)
        out["delta_rule"] = float(gdn * c.linear_num_value_heads * tokens * per_token)
    out["total"] = sum(out.values())
    return out
