"""The two passes of the loss over one chunk's logits z (r, V) (and the target's, zt):
`row_stats` reduces them to per-row numbers, `logit_grad` writes the gradient wrt the logits.
Eager on the CPU (where the tests compare them with float64); on CUDA the same functions run
through torch.compile, which fuses each into one or two kernels reading the low-precision logits
once or twice and keeps no fp32 [r, V] temporaries, or as the Triton kernels of
`trainer.loss.kernels` (`chunk_kernels` picks)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def _upcast(z: Tensor) -> Tensor:
    return z if z.dtype == torch.float64 else z.float()


def _row_stats(z: Tensor, y: Tensor, zt: Tensor | None) -> tuple[Tensor, ...]:
    """Per row: lse, log q(label), argmax == label, and with zt: lse_t and KL(p_t ‖ q)."""
    zf = _upcast(z)  # (r, V)
    lse = torch.logsumexp(zf, dim=-1)  # (r,)
    logq_y = zf.gather(1, y[:, None]).squeeze(1) - lse
    hit = zf.argmax(dim=-1) == y
    if zt is None:
        return lse, logq_y, hit
    ztf = _upcast(zt)
    lse_t = torch.logsumexp(ztf, dim=-1)
    # KL = Σ p_t·(log p_t − log q) = Σ p_t·(zt − z) − lse_t + lse
    kl = (torch.exp(ztf - lse_t[:, None]) * (ztf - zf)).sum(-1) - lse_t + lse
    return lse, logq_y, hit, lse_t, kl


def _logit_grad(
    z: Tensor,
    y: Tensor,
    lse: Tensor,
    a: Tensor,
    b: Tensor,
    zt: Tensor | None,
    lse_t: Tensor | None,
    c: Tensor | None,
) -> Tensor:
    """G = a·q − b·onehot(y) − c·p_t, returned in z's dtype (it feeds the G @ W GEMM)."""
    zf = _upcast(z)
    g = a[:, None] * torch.exp(zf - lse[:, None])  # (r, V)
    if zt is not None:
        assert lse_t is not None and c is not None
        g = g - c[:, None] * torch.exp(_upcast(zt) - lse_t[:, None])
    vocab = torch.arange(z.shape[1], device=z.device)
    g = g - torch.where(vocab[None, :] == y[:, None], b[:, None], 0.0)
    return g.to(z.dtype)


def _target_grad(
    z: Tensor, zt: Tensor, lse: Tensor, lse_t: Tensor, kl: Tensor, c: Tensor
) -> Tensor:
    """d(c·KL)/d zt = c·p_t ⊙ (log p_t − log q − KL), in the compute dtype (trainable weight only)."""
    logp = _upcast(zt) - lse_t[:, None]
    logq = _upcast(z) - lse[:, None]
    return c[:, None] * torch.exp(logp) * (logp - logq - kl[:, None])


KERNELS = ("eager", "compiled", "triton")


@dataclass(frozen=True)
class ChunkKernels:
    """The per-chunk functions of one kind; made once per process by `chunk_kernels`.

    `in_place` says that `logit_grad` writes G over the logits (no extra [chunk, V] buffer).
    """

    kind: str
    row_stats: Any
    logit_grad: Any
    target_grad: Any
    in_place: bool


@functools.cache
def chunk_kernels(kind: str) -> ChunkKernels:
    """The chunk functions: "eager" (the definition; CPU, float64), "compiled" (the same
    functions through torch.compile, dynamic in the row count) or "triton" (hand-written CUDA
    kernels, `trainer.loss.kernels`; the weight's gradient still goes through "compiled").

    `functools.cache` keeps one compiled object per process, so its compile cache is reused by
    every call instead of living in module globals.
    """
    if kind == "eager":
        return ChunkKernels(kind, _row_stats, _logit_grad, _target_grad, in_place=False)
    target_grad = torch.compile(_target_grad, dynamic=True)
    if kind == "compiled":
        return ChunkKernels(
            kind,
            torch.compile(_row_stats, dynamic=True),
            torch.compile(_logit_grad, dynamic=True),
            target_grad,
            in_place=False,
        )
    if kind == "triton":
        from trainer.loss import kernels as loss_kernels

        return ChunkKernels(
            kind, loss_kernels.row_stats, loss_kernels.logit_grad, target_grad, in_place=True
        )
    raise ValueError(f"kernels must be one of {KERNELS}, got {kind!r}")


def default_kernels(hidden: Tensor) -> str:
    """triton on CUDA when it imports, else compiled on CUDA; eager on the CPU and for float64."""
    if not hidden.is_cuda or hidden.dtype == torch.float64:
        return "eager"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "compiled"
    return "triton"


def bytes_per_logit(itemsize: int, *, kernels: ChunkKernels, kl: bool) -> int:
    """Peak bytes per [chunk, V] entry: logits (and target logits), G unless written in place,
    and the eager functions' fp32 temporaries."""
    per = itemsize * (2 if kl else 1) + (0 if kernels.in_place else itemsize)
    return per + (16 if kernels.kind == "eager" else 0)
