"""The DFlash attention mask: the dense reference and the FlexAttention `mask_mod` factories.

Keys are laid out as `[context 0 … S−1 | block 0 | block 1 | … | block N−1]`, queries as
`[block 0 | … | block N−1]`, each block B slots long (slot 0 holds the anchor token, the rest
the mask token). Query `n·B + k` (block n, slot k) sees

- context key `j < S` iff block n is valid, `j < anchors[n]` (strictly before its anchor) and,
  with a window W, `j >= anchors[n] + k − (W − 1)`;
- block key `S + n'·B + k'` iff `n' == n`, block n is valid and (without `causal_in_block`)
  any slot, or (with it) `k' <= k`; with a window W also `k' >= k − (W − 1)`.

The window is the one the serving engines (SGLang, vLLM, SpecForge's trainer) apply to a
sliding-window layer: slot k sits at position `anchor + k`, and a window of W positions ends at
(and includes) that position. So every slot has its own lower bound, one position later than
the slot before it.

Blocks never see each other. Rows of an invalid block see nothing; the attention paths return
zeros for them (see `trainer.model.attention`) and the loss ignores their labels.

`dense_mask` is the reference for one sequence; `batched_dense_mask` is the same rule
vectorised over a batch (it feeds SDPA); the `*_mask_mod` factories express it for
FlexAttention and must agree element for element (the tests check this through `create_mask`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

# FlexAttention's mask_mod signature: (batch, head, q_idx, kv_idx) -> bool, all 0-dim tensors.
MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _check_layout(anchors: Tensor, valid: Tensor, context_len: int, block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")
    if anchors.shape != valid.shape:
        raise ValueError(
            f"anchors {tuple(anchors.shape)} and valid {tuple(valid.shape)} must have one shape"
        )
    if valid.dtype != torch.bool:
        raise ValueError(f"valid must be a bool tensor, got {valid.dtype}")


def batched_dense_mask(
    anchors: Tensor,
    context_len: int,
    block_size: int,
    *,
    window: int | None = None,
    causal_in_block: bool = False,
    valid: Tensor | None = None,
) -> Tensor:
    """The mask for a batch: `anchors`, `valid` (Bsz, N) → bool (Bsz, N·B, S + N·B).

    Built from broadcast comparisons (no loop over sequences or blocks); the memory is the
    mask itself, Bsz·N·B·(S + N·B) bytes — callers bound it (see `trainer.model.attention`).
    """
    if valid is None:
        valid = torch.ones_like(anchors, dtype=torch.bool)
    _check_layout(anchors, valid, context_len, block_size)
    bsz, n_blocks = anchors.shape
    device = anchors.device
    b = block_size

    j = torch.arange(context_len, device=device)  # (S,)
    slot = torch.arange(b, device=device)  # (B,)
    start = anchors[..., None, None]  # (Bsz, N, 1, 1)
    sees_ctx = (j < start).expand(bsz, n_blocks, b, context_len)  # (Bsz, N, B, S)
    if window is not None:
        sees_ctx = sees_ctx & (j >= start + slot[:, None] - (window - 1))
    sees_ctx = sees_ctx & valid[..., None, None]
    sees_ctx = sees_ctx.reshape(bsz, n_blocks * b, context_len)

    own = torch.ones(b, b, dtype=torch.bool, device=device)  # (B query slots, B key slots)
    if causal_in_block:
        own &= slot[None, :] <= slot[:, None]
    if window is not None:
        own &= slot[None, :] >= slot[:, None] - (window - 1)
    same = torch.eye(n_blocks, dtype=torch.bool, device=device)  # (N, N')
    blocks = same[:, None, :, None] & own[None, :, None, :]  # (N, B, N', B')
    blocks = blocks.reshape(n_blocks * b, n_blocks * b)
    row_valid = valid.repeat_interleave(b, dim=1)  # (Bsz, N·B)
    blocks = blocks[None] & row_valid[:, :, None]  # (Bsz, N·B, N·B)
    return torch.cat([sees_ctx, blocks], dim=-1)


def dense_mask(
    anchors: Tensor,
    context_len: int,
    block_size: int,
    *,
    window: int | None = None,
    causal_in_block: bool = False,
    valid: Tensor | None = None,
) -> Tensor:
    """The reference mask for one sequence: `anchors`, `valid` (N,) → bool (N·B, S + N·B).

    True where the query (row) may attend to the key (column); see the module docstring.
    """
    if anchors.dim() != 1:
        raise ValueError(f"anchors must be 1-D (N,) for one sequence, got {tuple(anchors.shape)}")
    batch_valid = None if valid is None else valid[None]
    return batched_dense_mask(
        anchors[None],
        context_len,
        block_size,
        window=window,
        causal_in_block=causal_in_block,
        valid=batch_valid,
    )[0]


# --- FlexAttention mask_mods -------------------------------------------------------------------
# Small factories, each closing over the batch's tensors and returning a mask_mod. Everything a
# mask_mod reads that can vary within a process (context length, window) is a tensor indexed by
# the batch row, never a Python number: dynamo turns a number that changed between calls into a
# symbol, which FlexAttention's CuTe-DSL backend cannot take. The kernels evaluate mask_mod on
# whole query tiles, past Q = N·B on the last one: the per-block tensors are padded with invalid
# blocks up to `QUERY_TILE_PAD` rows, so those rows index safely (and see nothing; they are cut
# off after the kernel).

QUERY_TILE_PAD = 256  # the largest query tile of the kernels (Triton 128, CuTe DSL up to 256)


def padded_blocks(t: Tensor, block_size: int, fill: int | bool) -> Tensor:
    """`t` (Bsz, N) extended along N with `fill` to cover every row of the last query tile."""
    n = t.shape[1]
    rows = -(-n * block_size // QUERY_TILE_PAD) * QUERY_TILE_PAD
    need = -(-rows // block_size)
    if need <= n:
        return t
    pad = torch.full((t.shape[0], need - n), fill, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


def valid_block_mask_mod(valid: Tensor, block_size: int) -> MaskMod:
    """Rows of an invalid block (valid[b, n] False) see nothing. `valid`: (Bsz, N) bool."""
    padded = padded_blocks(valid, block_size, False)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return padded[b, q_idx // block_size]

    return mask_mod


def context_mask_mod(
    anchors: Tensor, context_lens: Tensor, block_size: int, *, reach: Tensor | None = None
) -> MaskMod:
    """Context keys strictly before the block's anchor (and, with a window W, at or after
    `anchor + k − (W − 1)` for slot k: the window ends at the slot's own position).
    `context_lens`: (Bsz,) the padded context length S of every row; `reach`: (Bsz,) W − 1, or
    None without a window."""
    padded = padded_blocks(anchors, block_size, 0)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        start = padded[b, q_idx // block_size]
        seen = (kv_idx < context_lens[b]) & (kv_idx < start)
        if reach is not None:
            seen = seen & (kv_idx >= start + q_idx % block_size - reach[b])
        return seen

    return mask_mod


def own_block_mask_mod(
    context_lens: Tensor,
    block_size: int,
    *,
    causal_in_block: bool = False,
    reach: Tensor | None = None,
) -> MaskMod:
    """Block keys of the query's own block (all slots, or slots `<= k` when causal; with a
    window W, slots `>= k − (W − 1)`). `context_lens`, `reach`: (Bsz,) as in `context_mask_mod`."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        key = kv_idx - context_lens[b]  # negative for context keys
        same = (key >= 0) & (key // block_size == q_idx // block_size)
        if causal_in_block:
            same = same & (key % block_size <= q_idx % block_size)
        if reach is not None:
            same = same & (key % block_size >= q_idx % block_size - reach[b])
        return same

    return mask_mod


def draft_mask_mod(
    anchors: Tensor,
    valid: Tensor,
    context_len: int,
    block_size: int,
    *,
    window: int | None = None,
    causal_in_block: bool = False,
) -> MaskMod:
    """The whole DFlash mask for a batch: valid ∧ (context ∨ own block). `anchors`, `valid`:
    (Bsz, N). The context length and the window reach the mask_mods as per-row tensors (one
    process may see several of each: layers with and without a window of their own, tests);
    the block size, fixed for a run, stays a number the kernels specialise on."""
    _check_layout(anchors, valid, context_len, block_size)

    def per_row(value: int) -> Tensor:
        return torch.full((anchors.shape[0],), value, dtype=anchors.dtype, device=anchors.device)

    context_lens = per_row(context_len)
    reach = None if window is None else per_row(window - 1)
    is_valid = valid_block_mask_mod(valid, block_size)
    ctx = context_mask_mod(anchors, context_lens, block_size, reach=reach)
    own = own_block_mask_mod(context_lens, block_size, causal_in_block=causal_in_block, reach=reach)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return is_valid(b, h, q_idx, kv_idx) & (ctx(b, h, q_idx, kv_idx) | own(b, h, q_idx, kv_idx))

    return mask_mod
