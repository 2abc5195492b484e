"""The DFlash loss over a frozen lm_head, computed chunk by chunk without [N·B, V] tensors.

`dflash_loss(hidden, weight, labels, *, gamma, ...)` takes the drafter's normed outputs
hidden (N, B, D), the target's lm_head weight (V, D) and labels (N, B) (−100 = ignored; slot 0
is always ignored) and returns `LossOutput(loss, ce, kl, cap, slot_accuracy)`:

- w_k = exp(−(k−1)/γ) for slot k ≥ 1 over non-ignored labels, W = Σ w;
- ce  = Σ w·CE / W;
- kl  = Σ w·KL(p_target ‖ p_drafter) / W, p_target = softmax(target_hidden @ weightᵀ);
- cap = −mean over blocks whose slot 1 is supervised of (1/(B−1))·Σ_{m=1}^{B−1} Π_{k≤m} π_k,
  π_k = p_drafter(label_k) and 0 for an ignored slot (which breaks the chain);
- loss = (1 − kl_weight)·ce + kl_weight·kl + cap_weight·cap.

How it runs (one `torch.autograd.Function`):

1. From the labels alone: the supervised rows, their weights w/W, and 1/(C·(B−1)) for cap
   (C = blocks whose slot 1 is supervised). Everything global is known before any logits.
2. Chunks of whole blocks (so cap's chain product stays inside a chunk). Per chunk, only the
   supervised rows are gathered (slot 0 and padding cost nothing): logits = h @ Wᵀ in the
   weight's dtype with an fp32 result, log-softmax in fp32, the loss terms, and — in the same
   pass — the gradient of the *combined* loss wrt the logits,
       G = (w/W + s)·q − ((1−α)·w/W + s)·onehot(label) − α·(w/W)·p_target,
   with α = kl_weight and s = cap_weight·S_k/(C·(B−1)), S_k = Σ_{m≥k} Π_{i≤m} π_i (the
   derivative of the chain products through log π_k). Then grad_hidden = G @ W (a second GEMM)
   is stored for those rows. With KL a third GEMM gives the target's logits.
3. Backward only scales the stored gradient by grad_output: no recomputation and no
   activation checkpointing, so it sits next to compiled attention without any interaction.

Memory: the stored gradient (N·B·D in hidden's dtype) plus a few [chunk, V] fp32 buffers; the
default chunk keeps those near `CHUNK_BUDGET_BYTES`. The weight's gradient is computed only
when `weight.requires_grad` (then into a (V, D) fp32 accumulator, including the KL term's path
through p_target, the exact gradient of the loss as defined); `target_hidden` is a constant.

Only `.loss` carries a gradient; `.ce`, `.kl`, `.cap` and `.slot_accuracy` are detached values
for logging. `slot_accuracy[k]` is NaN for slots without a supervised label (always slot 0).
Inputs that are all ignored give loss 0 (still attached to the graph, zero gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100
CHUNK_BUDGET_BYTES = 640 << 20
_BYTES_PER_LOGIT = 16  # ~3 fp32 [chunk, V] buffers and one low-precision copy, at the peak


@dataclass(frozen=True)
class LossOutput:
    """The combined loss (differentiable) and its detached terms (0-dim), per-slot accuracy (B,)."""

    loss: Tensor
    ce: Tensor
    kl: Tensor
    cap: Tensor
    slot_accuracy: Tensor


def default_chunk_rows(vocab_size: int, block_size: int) -> int:
    """Rows per chunk so that the chunk's [rows, V] buffers stay near `CHUNK_BUDGET_BYTES`."""
    rows = CHUNK_BUDGET_BYTES // (_BYTES_PER_LOGIT * vocab_size)
    return max(block_size, rows // block_size * block_size)


def _logits(h: Tensor, weight: Tensor, compute: torch.dtype) -> Tensor:
    """h (r, D) @ weightᵀ → (r, V) in `compute` dtype, the GEMM in the weight's dtype.

    On CUDA a bf16/fp16 GEMM writes fp32 directly (`out_dtype`), saving a rounding step and a
    low-precision [r, V] copy; elsewhere the result is upcast.
    """
    if h.is_cuda and weight.dtype in (torch.bfloat16, torch.float16) and compute == torch.float32:
        try:
            return torch.mm(h, weight.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return (h @ weight.t()).to(compute)


def _rowdot(a: Tensor, b: Tensor) -> Tensor:
    """Σ_v a[r, v]·b[r, v] → (r,) as a batched GEMV, without an [r, V] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(-1)


@dataclass(frozen=True, kw_only=True)
class _Plan:
    """What the labels decide before any logits exist."""

    rows: Tensor  # (R,) flat indices of supervised rows, sorted
    labels: Tensor  # (R,) their labels
    weight: Tensor  # (R,) w_k / Σ w (0 when nothing is supervised)
    slot: Tensor  # (R,) slot index k of each row
    cap_norm: float  # 1 / (C·(B−1)), 0 when no block has slot 1 supervised
    bounds: list[int]  # chunk c covers rows[bounds[c]:bounds[c+1]]
    chunk_blocks: int


def _plan(labels: Tensor, gamma: float, chunk_rows: int, compute: torch.dtype) -> _Plan:
    n_blocks, b = labels.shape
    slot = torch.arange(b, device=labels.device)
    supervised = (labels != IGNORE_INDEX) & (slot >= 1)  # (N, B)
    w = torch.exp(-(slot.to(compute) - 1) / gamma).expand(n_blocks, b) * supervised  # (N, B)
    total = w.sum()
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    flat = supervised.reshape(-1)
    rows = flat.nonzero().squeeze(1)  # (R,)
    chunk_blocks = max(1, chunk_rows // b)
    per_chunk = torch.nn.functional.pad(supervised.sum(1), (0, -n_blocks % chunk_blocks))
    per_chunk = per_chunk.view(-1, chunk_blocks).sum(1).cumsum(0)
    capped = int(supervised[:, 1].sum()) if b > 1 else 0
    return _Plan(
        rows=rows,
        labels=labels.reshape(-1)[rows],
        weight=w.reshape(-1)[rows],
        slot=rows % b,
        cap_norm=1.0 / (capped * (b - 1)) if capped else 0.0,
        bounds=[0, *per_chunk.tolist()],
        chunk_blocks=chunk_blocks,
    )


class _DFlashLoss(torch.autograd.Function):
    """Forward computes the loss terms and the gradients; backward scales them (see module doc)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        target_hidden: Tensor | None,
        plan: _Plan,
        coeffs: tuple[float, float],
        shape: tuple[int, int],
        need: tuple[bool, bool],
    ) -> tuple[Tensor, ...]:
        kl_weight, cap_weight = coeffs
        n_blocks, b = shape
        need_h, need_w = need
        compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        device = hidden.device
        flat_h = hidden.reshape(n_blocks * b, -1)  # (N·B, D)
        flat_t = None if target_hidden is None else target_hidden.reshape(n_blocks * b, -1)
        use_kl = flat_t is not None and kl_weight > 0

        grad_h = torch.zeros_like(flat_h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=compute, device=device) if need_w else None
        ce_sum = torch.zeros((), dtype=compute, device=device)
        kl_sum = torch.zeros((), dtype=compute, device=device)
        cap_sum = torch.zeros((), dtype=compute, device=device)
        correct = torch.zeros(b, dtype=compute, device=device)
        counted = torch.zeros(b, dtype=compute, device=device)

        for c in range(len(plan.bounds) - 1):
            lo, hi = plan.bounds[c], plan.bounds[c + 1]
            if hi == lo:
                continue
            rows = plan.rows[lo:hi]  # (r,)
            y = plan.labels[lo:hi]  # (r,)
            wn = plan.weight[lo:hi]  # (r,)
            slot = plan.slot[lo:hi]  # (r,)
            h = flat_h[rows].to(weight.dtype)  # (r, D)

            logq = _logits(h, weight, compute)  # (r, V)
            logq -= torch.logsumexp(logq, dim=-1, keepdim=True)
            logq_y = logq.gather(1, y[:, None]).squeeze(1)  # (r,)
            ce_sum += (wn * -logq_y).sum()
            correct.index_add_(0, slot, (logq.argmax(dim=-1) == y).to(compute))
            counted.index_add_(0, slot, torch.ones_like(wn))

            # cap: chain products over the chunk's whole blocks.
            first_block = int(c * plan.chunk_blocks)
            local = rows - first_block * b  # (r,) index inside the chunk's blocks
            n_local = plan.chunk_blocks
            pi = torch.zeros(n_local * b, dtype=compute, device=device)
            pi[local] = logq_y.exp()
            pi = pi.view(n_local, b)
            pi[:, 0] = 1.0
            chain = torch.cumprod(pi, dim=1)[:, 1:]  # (n_local, B−1): Π_{k=1}^{m} π_k
            cap_sum += chain.sum() / max(b - 1, 1)
            suffix = chain.flip(1).cumsum(1).flip(1)  # (n_local, B−1): Σ_{m≥k} chain_m
            suffix = torch.nn.functional.pad(suffix, (1, 0)).reshape(-1)[local]  # (r,)
            s = cap_weight * plan.cap_norm * suffix  # (r,) cap's share of the logit gradient

            p = None
            if use_kl:
                assert flat_t is not None
                logp = _logits(flat_t[rows].to(weight.dtype), weight, compute)  # (r, V)
                logp -= torch.logsumexp(logp, dim=-1, keepdim=True)
                p = logp.exp()  # (r, V)
                kl_row = _rowdot(p, logp) - _rowdot(p, logq)  # (r,)
                kl_sum += (wn * kl_row).sum()
                if need_w:
                    assert grad_w is not None
                    # d kl_row / d target logits = p ⊙ (log p − log q − kl_row)
                    gt = logp.sub_(logq).sub_(kl_row[:, None]).mul_(p)
                    gt.mul_((kl_weight * wn)[:, None])
                    grad_w.addmm_(gt.t(), flat_t[rows].to(compute))
                del logp

            if not (need_h or need_w):
                continue
            g = logq.exp_()  # q, in place: (r, V)
            g.mul_((wn + s)[:, None])
            if p is not None:
                g.sub_(p.mul_((kl_weight * wn)[:, None]))
            del p
            g.scatter_add_(1, y[:, None], -((1 - kl_weight) * wn + s)[:, None])
            if need_h:
                assert grad_h is not None
                grad_h[rows] = (g.to(weight.dtype) @ weight).to(grad_h.dtype)
            if need_w:
                assert grad_w is not None
                grad_w.addmm_(g.t(), h.to(compute))
            del g, logq

        ce = ce_sum
        kl = kl_sum
        cap = -cap_sum * plan.cap_norm * max(b - 1, 1)
        loss = (1 - kl_weight) * ce + kl_weight * kl + cap_weight * cap
        out_dtype = torch.promote_types(hidden.dtype, torch.float32)
        ctx.save_for_backward(
            *(t for t in (grad_h, grad_w) if t is not None),
        )
        ctx.has = (grad_h is not None, grad_w is not None)
        ctx.hidden_shape = hidden.shape
        ctx.weight_dtype = weight.dtype
        accuracy = correct / counted  # NaN where nothing was counted
        results = tuple(t.to(out_dtype) for t in (loss, ce, kl, cap, accuracy))
        ctx.mark_non_differentiable(*results[1:])
        return results

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: Tensor, *_: Any) -> tuple[Tensor | None, ...]:
        saved = list(ctx.saved_tensors)
        has_h, has_w = ctx.has
        grad_h = saved.pop(0) if has_h else None
        grad_w = saved.pop(0) if has_w else None
        # A Python float keeps the scale exact: reduced-precision kernels apply it in fp32.
        scale = float(grad_loss)
        out_h = None if grad_h is None else (grad_h * scale).view(ctx.hidden_shape)
        out_w = None if grad_w is None else (grad_w * scale).to(ctx.weight_dtype)
        return out_h, out_w, None, None, None, None, None


def dflash_loss(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    gamma: float,
    target_hidden: Tensor | None = None,
    kl_weight: float = 0.0,
    cap_weight: float = 0.0,
    chunk_rows: int | None = None,
) -> LossOutput:
    """The DFlash loss (see the module docstring for the definition and how it is computed).

    hidden (N, B, D), weight (V, D), labels (N, B) long, target_hidden (N, B, D) or None.
    `chunk_rows` is rounded down to whole blocks (at least one); None picks it from the
    vocabulary size (`default_chunk_rows`).
    """
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (N, B, D), got {tuple(hidden.shape)}")
    n_blocks, b, d = hidden.shape
    if labels.shape != (n_blocks, b):
        raise ValueError(f"labels {tuple(labels.shape)} must be (N, B) = {(n_blocks, b)}")
    if weight.dim() != 2 or weight.shape[1] != d:
        raise ValueError(f"weight {tuple(weight.shape)} must be (V, {d})")
    if target_hidden is not None and target_hidden.shape != hidden.shape:
        raise ValueError(
            f"target_hidden {tuple(target_hidden.shape)} must match hidden {tuple(hidden.shape)}"
        )
    if not gamma > 0:
        raise ValueError(f"gamma must be > 0, got {gamma}")
    if not 0.0 <= kl_weight <= 1.0:
        raise ValueError(f"kl_weight must be in [0, 1], got {kl_weight}")
    if kl_weight > 0 and target_hidden is None:
        raise ValueError("kl_weight > 0 needs target_hidden (the target's last hidden states)")
    if not math.isfinite(cap_weight):
        raise ValueError(f"cap_weight must be finite, got {cap_weight}")

    compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    rows = chunk_rows if chunk_rows is not None else default_chunk_rows(weight.shape[0], b)
    plan = _plan(labels, gamma, rows, compute)
    grad_on = torch.is_grad_enabled()
    need = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    target = None if target_hidden is None else target_hidden.detach()
    with torch.autocast(hidden.device.type, enabled=False):
        loss, ce, kl, cap, accuracy = _DFlashLoss.apply(
            hidden, weight, target, plan, (kl_weight, cap_weight), (n_blocks, b), need
        )
    return LossOutput(loss=loss, ce=ce, kl=kl, cap=cap, slot_accuracy=accuracy)
