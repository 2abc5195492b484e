"""Triton kernels for the loss's two passes over a chunk's logits (CUDA only).

`row_stats` reads the logits z (r, V) (and the target's zt) once: each program reduces one
slice of a row to an online max / Σexp (and, with a target, Σ exp(zt)·(zt − z) for the KL) and
a running argmax; the few partials per row are combined in torch. `logit_grad` then writes
G = a·q − c·p_t − b·onehot(y) over z in place, in z's dtype (bf16), ready for the G @ W GEMM.

Together they read the bf16 logits twice and write them once, which is what the chunked loss
needs to stay close to its GEMM floor; the eager functions in `trainer.loss.dflash_loss` define the same
numbers and the GPU tests compare the two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 2048
MAX_SPLIT = 16


@triton.jit
def _stats_kernel(
    z_ptr,
    zt_ptr,
    part_ptr,  # (r, SPLIT, 5) fp32: max, Σexp, max_t, Σexp_t, Σexp_t·(zt − z)
    idx_ptr,  # (r, SPLIT) int32: argmax inside the slice
    best_ptr,  # (r, SPLIT) fp32: the max value at that index
    V,
    stride_z,
    stride_zt,
    SPLIT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_T: tl.constexpr,
):
    row = tl.program_id(0)
    part = tl.program_id(1)
    start = part * CHUNK
    z_row = z_ptr + row.to(tl.int64) * stride_z
    zt_row = zt_ptr + row.to(tl.int64) * stride_zt
    m = -float("inf")
    s = 0.0
    best = -float("inf")
    best_idx = 0
    mt = -float("inf")
    st = 0.0
    ut = 0.0
    for off in range(0, CHUNK, BLOCK_V):
        cols = start + off + tl.arange(0, BLOCK_V)
        mask = (off + tl.arange(0, BLOCK_V) < CHUNK) & (cols < V)
        x = tl.load(z_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
        bm = tl.max(x, 0)
        bi = tl.argmax(x, 0)
        take = bm > best
        best_idx = tl.where(take, start + off + bi, best_idx)
        best = tl.where(take, bm, best)
        new_m = tl.maximum(m, bm)
        scale = tl.where(m == -float("inf"), 0.0, tl.exp(m - new_m))
        s = s * scale + tl.sum(tl.where(mask, tl.exp(x - new_m), 0.0), 0)
        m = new_m
        if HAS_T:
            xt = tl.load(zt_row + cols, mask=mask, other=-float("inf")).to(tl.float32)
            new_mt = tl.maximum(mt, tl.max(xt, 0))
            scale_t = tl.where(mt == -float("inf"), 0.0, tl.exp(mt - new_mt))
            e = tl.where(mask, tl.exp(xt - new_mt), 0.0)
            st = st * scale_t + tl.sum(e, 0)
            ut = ut * scale_t + tl.sum(e * tl.where(mask, xt - x, 0.0), 0)
            mt = new_mt
    out = part_ptr + (row.to(tl.int64) * SPLIT + part) * 5
    tl.store(out + 0, m)
    tl.store(out + 1, s)
    tl.store(out + 2, mt)
    tl.store(out + 3, st)
    tl.store(out + 4, ut)
    tl.store(idx_ptr + row.to(tl.int64) * SPLIT + part, best_idx)
    tl.store(best_ptr + row.to(tl.int64) * SPLIT + part, best)


@triton.jit
def _grad_kernel(
    z_ptr,
    zt_ptr,
    y_ptr,
    lse_ptr,
    lse_t_ptr,
    a_ptr,
    b_ptr,
    c_ptr,
    V,
    stride_z,
    stride_zt,
    BLOCK_V: tl.constexpr,
    HAS_T: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    z_row = z_ptr + row.to(tl.int64) * stride_z
    x = tl.load(z_row + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(a_ptr + row) * tl.exp(x - tl.load(lse_ptr + row))
    if HAS_T:
        zt_row = zt_ptr + row.to(tl.int64) * stride_zt
        xt = tl.load(zt_row + cols, mask=mask, other=0.0).to(tl.float32)
        g -= tl.load(c_ptr + row) * tl.exp(xt - tl.load(lse_t_ptr + row))
    y = tl.load(y_ptr + row)
    g = tl.where(cols == y, g - tl.load(b_ptr + row), g)
    tl.store(z_row + cols, g.to(z_ptr.dtype.element_ty), mask=mask)


def _split_for(vocab: int) -> int:
    return max(1, min(MAX_SPLIT, triton.cdiv(vocab, 8 * BLOCK)))


def row_stats(
    z: Tensor, y: Tensor, zt: Tensor | None, *, split: int | None = None
) -> tuple[Tensor, ...]:
    """Same results as `trainer.loss.chunk_passes._row_stats`: lse, log q(y), argmax == y[, lse_t, KL]."""
    r, vocab = z.shape
    split = _split_for(vocab) if split is None else split
    chunk = triton.cdiv(triton.cdiv(vocab, split), BLOCK) * BLOCK
    parts = torch.empty(r, split, 5, device=z.device, dtype=torch.float32)
    idx = torch.empty(r, split, device=z.device, dtype=torch.int32)
    best = torch.empty(r, split, device=z.device, dtype=torch.float32)
    has_t = zt is not None
    zt_arg = z if zt is None else zt
    with torch.cuda.device(z.device):  # Triton launches on the current device's stream
        _stats_kernel[(r, split)](
            z,
            zt_arg,
            parts,
            idx,
            best,
            vocab,
            z.stride(0),
            zt_arg.stride(0),
            SPLIT=split,
            CHUNK=chunk,
            BLOCK_V=BLOCK,
            HAS_T=has_t,
            num_warps=8,
        )
    m, s = parts[..., 0], parts[..., 1]  # (r, split)
    top = m.max(dim=1).values  # (r,)
    lse = top + torch.log((s * torch.exp(m - top[:, None])).sum(1))
    winner = best.argmax(dim=1, keepdim=True)  # first slice holding the maximum
    hit = idx.gather(1, winner).squeeze(1).long() == y
    logq_y = z.gather(1, y[:, None]).squeeze(1).float() - lse
    if not has_t:
        return lse, logq_y, hit
    mt, st, ut = parts[..., 2], parts[..., 3], parts[..., 4]
    top_t = mt.max(dim=1).values
    lse_t = top_t + torch.log((st * torch.exp(mt - top_t[:, None])).sum(1))
    kl = (ut * torch.exp(mt - lse_t[:, None])).sum(1) - lse_t + lse
    return lse, logq_y, hit, lse_t, kl


def logit_grad(
    z: Tensor,
    y: Tensor,
    lse: Tensor,
    a: Tensor,
    b: Tensor,
    zt: Tensor | None,
    lse_t: Tensor | None,
    c: Tensor | None,
) -> Tensor:
    """Same result as `trainer.loss.chunk_passes._logit_grad`, written over z in place (z is returned)."""
    r, vocab = z.shape
    has_t = zt is not None
    zt_arg, lse_t_arg, c_arg = z, lse, a
    if zt is not None:  # a teacher: its lse and KL weights come with it
        assert lse_t is not None and c is not None
        zt_arg, lse_t_arg, c_arg = zt, lse_t, c
    f32 = torch.float32
    lse_t_arg = lse_t_arg.to(f32).contiguous()
    c_arg = c_arg.to(f32).contiguous()
    with torch.cuda.device(z.device):  # Triton launches on the current device's stream
        _grad_kernel[(r, triton.cdiv(vocab, BLOCK))](
            z,
            zt_arg,
            y.contiguous(),
            lse.to(f32).contiguous(),
            lse_t_arg,
            a.to(f32).contiguous(),
            b.to(f32).contiguous(),
            c_arg,
            vocab,
            z.stride(0),
            zt_arg.stride(0),
            BLOCK_V=BLOCK,
            HAS_T=has_t,
            num_warps=8,
        )
    return z
