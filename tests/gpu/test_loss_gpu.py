"""dflash_loss on CUDA: bf16 inputs against the float64 definition, and peak memory at the
benchmark size (run with `pytest tests/gpu`)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_loss import reference
from trainer.loss import IGNORE_INDEX, dflash_loss

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GIB = float(1 << 30)


def make(n, b, d, v, *, dtype, seed=0, ignore=0.2):
    g = torch.Generator(device="cuda").manual_seed(seed)
    hidden = torch.randn(n, b, d, generator=g, device="cuda").to(dtype)
    weight = (torch.randn(v, d, generator=g, device="cuda") * (2 / math.sqrt(d))).to(dtype)
    target = (hidden.float() + 0.5 * torch.randn(n, b, d, generator=g, device="cuda")).to(dtype)
    labels = torch.randint(0, v, (n, b), generator=g, device="cuda")
    labels[torch.rand(n, b, generator=g, device="cuda") < ignore] = IGNORE_INDEX
    return hidden, weight, target, labels


def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize(
    "dtype,value_tol,grad_tol",
    [(torch.float32, 1e-4, 1e-3), (torch.bfloat16, 5e-3, 3e-2)],
    ids=["fp32", "bf16"],
)
@pytest.mark.parametrize("weight_trains", [False, True], ids=["frozen", "trainable"])
def test_cuda_loss_matches_float64(dtype, value_tol, grad_tol, weight_trains):
    hidden, weight, target, labels = make(48, 16, 256, 8192, dtype=dtype)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(weight_trains)
    out = dflash_loss(
        h,
        w,
        labels,
        gamma=7.0,
        target_hidden=target,
        kl_weight=0.15,
        cap_weight=0.1,
        chunk_rows=160,
    )
    out.loss.backward()
    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(weight_trains)
    ref = reference(
        h64,
        w64,
        labels.cpu(),
        gamma=7.0,
        target_hidden=target.double(),
        kl_weight=0.15,
        cap_weight=0.1,
    )
    ref[0].backward()
    for got, want in zip((out.loss, out.ce, out.kl, out.cap), ref, strict=True):
        assert abs(float(got) - float(want)) <= value_tol * max(1e-2, abs(float(want)))
    assert rel(h.grad, h64.grad) < grad_tol
    if weight_trains:
        assert rel(w.grad, w64.grad) < grad_tol
    else:
        assert w.grad is None


def test_peak_memory_at_benchmark_size():
    """N·B = 16,384 rows, D = 5,120, V = 248,320, bf16, CE + KL, frozen lm_head: ≤ 1 GiB extra."""
    hidden, weight, target, labels = make(1024, 16, 5120, 248320, dtype=torch.bfloat16)
    h = hidden.requires_grad_(True)

    def step():
        h.grad = None
        out = dflash_loss(h, weight, labels, gamma=7.0, target_hidden=target, kl_weight=0.15)
        out.loss.backward()
        return out

    step()
    torch.cuda.synchronize()
    h.grad = None
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    out = step()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / GIB
    assert peak <= 1.0, f"peak extra {peak:.2f} GiB"
    assert torch.isfinite(out.loss) and torch.isfinite(h.grad).all()
