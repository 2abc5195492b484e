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
   supervised rows are gathered (slot 0 and padding cost nothing): logits z = h @ Wᵀ, a GEMM
   in the weight's dtype (bf16: fp32 accumulation, logits rounded to bf16 once), then in fp32
   the per-row statistics (log-sum-exp, log q(label), argmax, KL) and, in a second pass, the
   gradient of the *combined* loss wrt the logits,
       G = (w/W + s)·q − ((1−α)·w/W + s)·onehot(label) − α·(w/W)·p_target,
   with α = kl_weight and s = cap_weight·S_k/(C·(B−1)), S_k = Σ_{m≥k} Π_{i≤m} π_i (the
   derivative of the chain products through log π_k). Then grad_hidden = G @ W (the second
   GEMM) is stored for those rows. With a target, one more GEMM gives its logits.
   On CUDA the two passes are Triton kernels (`trainer.loss.kernels`) that read the bf16
   logits twice and write G over them in place, instead of a dozen eager passes over fp32
   copies (`chunk_kernels` also offers the torch.compile'd eager functions).
3. Backward only scales the stored gradient by grad_output: no recomputation and no
   activation checkpointing, so it sits next to compiled attention without any interaction.

Memory: the stored gradient (N·B·D in hidden's dtype) plus the chunk's logits (and target
logits), [chunk, V] each in the weight's dtype (G overwrites the logits with Triton); the default chunk keeps those near
`CHUNK_BUDGET_BYTES`. The weight's gradient is computed only when `weight.requires_grad` (then
into a (V, D) fp32 accumulator, including the KL term's path through p_target, the exact
gradient of the loss as defined); `target_hidden` is a constant. `kl` is computed whenever
`target_hidden` is given (0 otherwise), whatever `kl_weight` is.

A batch trained in parts (`data.micro_batches`) passes the whole batch's normalisers W and C
(`loss_norms`) to the loss of each part: the parts' losses, terms and gradients then add up to
the whole batch's.

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

from trainer.loss.chunk_passes import ChunkKernels, bytes_per_logit, chunk_kernels, default_kernels

IGNORE_INDEX = -100
CHUNK_BUDGET_BYTES = 640 << 20


@dataclass(frozen=True)
class LossOutput:
    """The combined loss (differentiable) and its detached terms (0-dim), per-slot accuracy (B,)."""

    loss: Tensor
    ce: Tensor
    kl: Tensor
    cap: Tensor
    slot_accuracy: Tensor


@dataclass(frozen=True)
class LossNorms:
    """The loss's normalisers over a batch: W = Σ w (ce and kl) and C, the blocks whose slot 1
    is supervised (cap)."""

    weight_total: Tensor  # () W, in the loss's compute dtype
    cap_blocks: int


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The loss's own precision for inputs of `dtype`: fp64 stays fp64, the rest is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _supervised_weights(labels: Tensor, gamma: float, compute: torch.dtype) -> Tensor:
    """(N, B) w_k = exp(−(k−1)/γ) where slot k ≥ 1 has a label, else 0."""
    n_blocks, b = labels.shape
    slot = torch.arange(b, device=labels.device)
    supervised = (labels != IGNORE_INDEX) & (slot >= 1)
    return torch.exp(-(slot.to(compute) - 1) / gamma).expand(n_blocks, b) * supervised


def _cap_blocks(labels: Tensor) -> int:
    """C: the blocks of `labels` (N, B) whose slot 1 is supervised."""
    return int((labels[:, 1] != IGNORE_INDEX).sum()) if labels.shape[1] > 1 else 0


def loss_norms(labels: Tensor, gamma: float, dtype: torch.dtype = torch.float32) -> LossNorms:
    """W and C of `labels` (N, B), for inputs of `dtype` (`compute_dtype`): what the loss of each
    part of a batch divides by, so that the parts add up to the whole."""
    w = _supervised_weights(labels, gamma, compute_dtype(dtype))
    return LossNorms(weight_total=w.sum(), cap_blocks=_cap_blocks(labels))


def default_chunk_rows(vocab_size: int, block_size: int, *, bytes_per_logit: int) -> int:
    """Rows per chunk so that the chunk's [rows, V] buffers stay near `CHUNK_BUDGET_BYTES`.

    Rounded down to a multiple of 128 rows when that large (whole GEMM tiles), then to whole
    blocks.
    """
    rows = CHUNK_BUDGET_BYTES // (bytes_per_logit * vocab_size)
    if rows >= 128:
        rows = rows // 128 * 128
    return max(block_size, rows // block_size * block_size)


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


def _plan(
    labels: Tensor,
    gamma: float,
    chunk_rows: int,
    compute: torch.dtype,
    norms: LossNorms | None,
    device: torch.device,
) -> _Plan:
    """`norms`: the whole batch's W and C when `labels` are a part of it; None: these labels'.
    Worked out where `labels` are: labels on the CPU (the batch before it went to the GPU) let
    the host plan the chunks without waiting for the device; the plan's tensors then go to
    `device` without a sync."""
    n_blocks, b = labels.shape
    slot = torch.arange(b, device=labels.device)
    supervised = (labels != IGNORE_INDEX) & (slot >= 1)  # (N, B)
    w = _supervised_weights(labels, gamma, compute)  # (N, B)
    total = w.sum() if norms is None else norms.weight_total.to(labels.device, compute)
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    flat = supervised.reshape(-1)
    rows = flat.nonzero().squeeze(1)  # (R,)
    chunk_blocks = max(1, chunk_rows // b)
    per_chunk = torch.nn.functional.pad(supervised.sum(1), (0, -n_blocks % chunk_blocks))
    per_chunk = per_chunk.view(-1, chunk_blocks).sum(1).cumsum(0)
    capped = _cap_blocks(labels) if norms is None else norms.cap_blocks
    return _Plan(
        rows=_to(rows, device),
        labels=_to(labels.reshape(-1)[rows], device),
        weight=_to(w.reshape(-1)[rows], device),
        slot=_to(rows % b, device),
        cap_norm=1.0 / (capped * (b - 1)) if capped else 0.0,
        bounds=[0, *per_chunk.tolist()],
        chunk_blocks=chunk_blocks,
    )


def _to(t: Tensor, device: torch.device) -> Tensor:
    """To `device` without waiting: from pinned memory when it crosses from the CPU."""
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _cap_chains(logq_y: Tensor, local: Tensor, blocks: int, b: int) -> tuple[Tensor, Tensor]:
    """cap's chains inside one chunk of whole blocks.

    `logq_y` (r,): log p_drafter(label) of the chunk's supervised rows at positions `local`
    (row index inside the chunk). Unsupervised slots get π = 0, so a chain stops there.
    Returns Σ over blocks and m of Π_{k=1}^{m} π_k, and per supervised row the suffix sum
    S_k = Σ_{m≥k} Π_{i≤m} π_i: the derivative of that sum wrt log π_k.
    """
    pi = torch.zeros(blocks * b, dtype=logq_y.dtype, device=logq_y.device)
    pi[local] = logq_y.exp()
    pi = pi.view(blocks, b)
    pi[:, 0] = 1.0  # slot 0 is not part of any chain
    chain = torch.cumprod(pi, dim=1)[:, 1:]  # (blocks, B−1)
    suffix = chain.flip(1).cumsum(1).flip(1)  # (blocks, B−1)
    suffix = torch.nn.functional.pad(suffix, (1, 0)).reshape(-1)[local]  # (r,)
    return chain.sum(), suffix


class _DFlashLoss(torch.autograd.Function):
    """Forward computes the loss terms and the gradients; backward scales them (see module doc)."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: Tensor,
        weight: Tensor,
        target_hidden: Tensor | None,
        plan: _Plan,
        coeffs: tuple[float, float],
        need: tuple[bool, bool],
        kernels: ChunkKernels,
    ) -> tuple[Tensor, ...]:
        kl_weight, cap_weight = coeffs
        n_blocks, b, _ = hidden.shape
        need_h, need_w = need
        compute = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        device = hidden.device
        flat_h = hidden.reshape(n_blocks * b, -1)  # (N·B, D)
        flat_t = None
        if target_hidden is not None:
            flat_t = target_hidden.reshape(n_blocks * b, -1)  # (N·B, D)

        grad_h = torch.zeros_like(flat_h) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=compute, device=device) if need_w else None
        sums = torch.zeros(3, dtype=compute, device=device)  # Σ w·CE, Σ w·KL, Σ chains
        correct = torch.zeros(b, dtype=compute, device=device)
        counted = torch.zeros(b, dtype=compute, device=device)

        for chunk in range(len(plan.bounds) - 1):
            lo, hi = plan.bounds[chunk], plan.bounds[chunk + 1]
            if hi == lo:
                continue
            rows = plan.rows[lo:hi]  # (r,)
            y = plan.labels[lo:hi]  # (r,)
            wn = plan.weight[lo:hi]  # (r,)
            slot = plan.slot[lo:hi]  # (r,)
            h = flat_h[rows].to(weight.dtype)  # (r, D)
            z = h @ weight.t()  # (r, V), logits in the weight's dtype
            zt = None if flat_t is None else flat_t[rows].to(weight.dtype) @ weight.t()

            stats = kernels.row_stats(z, y, zt)
            lse, logq_y, hit = stats[0], stats[1], stats[2]
            sums[0] += (wn * -logq_y).sum()
            if zt is not None:
                lse_t, kl_row = stats[3], stats[4]
                sums[1] += (wn * kl_row).sum()
            correct.index_add_(0, slot, hit.to(compute))
            counted.index_add_(0, slot, torch.ones_like(wn))

            local = rows - chunk * plan.chunk_blocks * b  # (r,) position inside the chunk
            chain_sum, suffix = _cap_chains(logq_y.to(compute), local, plan.chunk_blocks, b)
            sums[2] += chain_sum

            if not (need_h or need_w):
                continue
            s = cap_weight * plan.cap_norm * suffix  # (r,) cap's share of the logit gradient
            a = wn + s
            b_coef = (1 - kl_weight) * wn + s
            c = kl_weight * wn if zt is not None else None
            if need_w and zt is not None:
                assert grad_w is not None and flat_t is not None and c is not None
                gt = kernels.target_grad(z, zt, lse, lse_t, kl_row, c)  # (r, V)
                grad_w.addmm_(gt.t(), flat_t[rows].to(compute))
                del gt
            g = kernels.logit_grad(
                z, y, lse, a, b_coef, zt, stats[3] if zt is not None else None, c
            )
            del z, zt
            if need_h:
                assert grad_h is not None
                grad_h[rows] = (g @ weight).to(grad_h.dtype)
            if need_w:
                assert grad_w is not None
                grad_w.addmm_(g.t().to(compute), h.to(compute))
            del g

        ce, kl = sums[0], sums[1]
        cap = -sums[2] * plan.cap_norm  # −(1/C)·Σ_blocks (1/(B−1))·Σ_m Π π
        loss = (1 - kl_weight) * ce + kl_weight * kl + cap_weight * cap
        ctx.save_for_backward(*(t for t in (grad_h, grad_w) if t is not None))
        ctx.has = (grad_h is not None, grad_w is not None)
        ctx.hidden_shape = hidden.shape
        ctx.weight_dtype = weight.dtype
        ctx.compute = compute
        accuracy = correct / counted  # NaN where nothing was counted
        out_dtype = torch.promote_types(hidden.dtype, torch.float32)
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
        # The scale stays a device tensor (reading it would wait for the device) and is applied
        # in the loss's own precision, never rounded to a bf16 gradient's.
        scale = grad_loss.to(ctx.compute)
        out_h = None if grad_h is None else _scaled(grad_h, scale).view(ctx.hidden_shape)
        out_w = None if grad_w is None else (grad_w * scale).to(ctx.weight_dtype)
        return out_h, out_w, None, None, None, None, None


def _scaled(grad: Tensor, scale: Tensor) -> Tensor:
    """grad · scale computed in the scale's precision, returned in grad's dtype."""
    return (grad.to(scale.dtype) * scale).to(grad.dtype)


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
    kernels: str | None = None,
    norms: LossNorms | None = None,
) -> LossOutput:
    """The DFlash loss (see the module docstring for the definition and how it is computed).

    hidden (N, B, D), weight (V, D), labels (N, B) long, target_hidden (N, B, D) or None.
    `chunk_rows` is rounded down to whole blocks (at least one); None picks it from the
    vocabulary size (`default_chunk_rows`). `kernels` picks the per-chunk functions
    ("eager", "compiled", "triton"; default `default_kernels`). `norms`: the whole batch's
    (`loss_norms`) when these rows are a part of it. `labels` may stay on the CPU while `hidden`
    is on a GPU: the loss then plans its chunks on the host and never waits for the device.
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

    compute = compute_dtype(hidden.dtype)
    use_kl = target_hidden is not None
    chunk = chunk_kernels(default_kernels(hidden) if kernels is None else kernels)
    if chunk_rows is None:
        per = bytes_per_logit(weight.element_size(), kernels=chunk, kl=use_kl)
        chunk_rows = default_chunk_rows(weight.shape[0], b, bytes_per_logit=per)
    plan = _plan(labels, gamma, chunk_rows, compute, norms, hidden.device)
    grad_on = torch.is_grad_enabled()
    need = (grad_on and hidden.requires_grad, grad_on and weight.requires_grad)
    target = None if target_hidden is None else target_hidden.detach()
    with torch.autocast(hidden.device.type, enabled=False):
        loss, ce, kl, cap, accuracy = _DFlashLoss.apply(
            hidden, weight, target, plan, (kl_weight, cap_weight), need, chunk
        )
    return LossOutput(loss=loss, ce=ce, kl=kl, cap=cap, slot_accuracy=accuracy)
