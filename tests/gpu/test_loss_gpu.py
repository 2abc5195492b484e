"""dflash_loss on CUDA: bf16 inputs against the float64 definition, and peak memory at the
benchmark size (run with `pytest tests/gpu`)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer.test_loss import reference
from trainer.loss.chunk_passes import _logit_grad, _row_stats
from trainer.loss.dflash_loss import IGNORE_INDEX, dflash_loss

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
@pytest.mark.parametrize("kernels", ["triton", "compiled"])
def test_cuda_loss_matches_float64(dtype, value_tol, grad_tol, weight_trains, kernels):
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
        kernels=kernels,
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


@pytest.mark.parametrize("vocab,split", [(5000, None), (100, 16), (31040, 3)])
@pytest.mark.parametrize("with_target", [False, True], ids=["ce", "kl"])
def test_triton_chunk_kernels_match_eager(vocab, split, with_target):
    """The Triton passes against the eager definition, incl. empty row slices (V=100, 16 splits)."""
    loss_kernels = pytest.importorskip("trainer.loss.kernels")
    g = torch.Generator(device="cuda").manual_seed(0)
    r = 37
    z = (4 * torch.randn(r, vocab, generator=g, device="cuda")).bfloat16()
    zt = (4 * torch.randn(r, vocab, generator=g, device="cuda")).bfloat16() if with_target else None
    y = torch.randint(0, vocab, (r,), generator=g, device="cuda")
    y[:5] = z[:5].float().argmax(-1)  # some certain hits
    want = _row_stats(z, y, zt)
    got = loss_kernels.row_stats(z, y, zt, split=split)
    assert len(got) == len(want)
    assert torch.equal(got[2], want[2])  # hits
    for i in (0, 1, 3, 4)[: len(want) - 1]:
        torch.testing.assert_close(got[i], want[i], rtol=1e-5, atol=1e-4)
    a, b, c = (torch.rand(r, generator=g, device="cuda") for _ in range(3))
    lse_t = want[3] if with_target else None
    c = c if with_target else None
    want_g = _logit_grad(z, y, want[0], a, b, zt, lse_t, c)
    got_g = loss_kernels.logit_grad(z.clone(), y, want[0], a, b, zt, lse_t, c)
    torch.testing.assert_close(got_g.float(), want_g.float(), rtol=1e-2, atol=1e-6)


def test_loss_next_to_compiled_attention():
    """Compiled flex attention and the Triton loss in one forward/backward (the seed's failing
    combination), against SDPA + the eager loss on the same bf16 autocast graph."""
    from trainer.model.attention import build_draft_mask, draft_attention

    g = torch.Generator(device="cuda").manual_seed(0)
    bsz, n, b, s, heads, hd, vocab = 2, 16, 16, 512, 4, 64, 4096
    d = heads * hd
    anchors = torch.sort(torch.randint(1, s, (bsz, n), generator=g, device="cuda"), 1).values
    valid = torch.ones(bsz, n, dtype=torch.bool, device="cuda")
    valid[0, 3] = False
    context = torch.randn(bsz, s, d, generator=g, device="cuda")
    blocks = torch.randn(bsz, n * b, d, generator=g, device="cuda")
    params = [
        (torch.randn(d, d, generator=g, device="cuda") / d**0.5).requires_grad_(True)
        for _ in range(4)
    ]
    lm_head = (torch.randn(vocab, d, generator=g, device="cuda") / d**0.5).bfloat16()
    labels = torch.randint(0, vocab, (bsz * n, b), generator=g, device="cuda")
    labels[~valid.reshape(-1)] = IGNORE_INDEX

    def step(backend: str, kernels: str):
        for p in params:
            p.grad = None
        wq, wk, wv, wo = params
        mask = build_draft_mask(anchors, valid, s, b, backend=backend, num_heads=heads)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            keys = torch.cat([context, blocks], dim=1)  # (Bsz, S + N·B, d)
            q = (blocks @ wq).view(bsz, n * b, heads, hd).transpose(1, 2)
            k = (keys @ wk).view(bsz, s + n * b, heads, hd).transpose(1, 2)
            v = (keys @ wv).view(bsz, s + n * b, heads, hd).transpose(1, 2)
            o = draft_attention(q, k, v, mask).transpose(1, 2).reshape(bsz, n * b, d) @ wo
        out = dflash_loss(
            o.reshape(bsz * n, b, d), lm_head, labels, gamma=7.0, cap_weight=0.1, kernels=kernels
        )
        out.loss.backward()
        return out.loss.detach(), [p.grad.clone() for p in params]

    loss, grads = step("flex", "triton")
    ref_loss, ref_grads = step("sdpa", "eager")
    assert torch.isfinite(loss)
    assert abs(float(loss) - float(ref_loss)) < 1e-2 * abs(float(ref_loss))
    for got, want in zip(grads, ref_grads, strict=True):
        assert torch.isfinite(got).all()
        assert rel(got, want) < 5e-2


def test_host_labels_plan_without_a_sync_and_give_the_same_loss():
    """Labels on the CPU (the batch before it went to the GPU): the loss and its backward queue
    their kernels without one device sync, and equal the loss planned from CUDA labels (up to
    the last bit of the slot weights, exp on the CPU against exp on the GPU)."""
    hidden, weight, target, labels = make(64, 8, 256, 4096, dtype=torch.bfloat16, seed=3)
    outs, grads = [], []
    for lab in (labels, labels.cpu()):
        h = hidden.clone().requires_grad_(True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if lab.device.type == "cpu" else "default")
        try:
            out = dflash_loss(
                h, weight, lab, gamma=4.0, target_hidden=target, kl_weight=0.15, chunk_rows=64
            )
            (out.loss * 3.7).backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        outs.append(torch.stack([out.loss, out.ce, out.kl, out.cap]))
        grads.append(h.grad)
    assert torch.allclose(outs[0], outs[1], rtol=1e-5, atol=1e-7)
    assert rel(grads[1], grads[0]) < 1e-2


def test_grad_output_scales_a_bf16_gradient_in_float32_on_cuda():
    hidden, weight, _, labels = make(32, 8, 128, 1024, dtype=torch.bfloat16, seed=4)
    h1, h2 = (hidden.clone().requires_grad_(True) for _ in range(2))
    dflash_loss(h1, weight, labels, gamma=4.0).loss.backward()
    (dflash_loss(h2, weight, labels, gamma=4.0).loss * 3.7).backward()
    assert torch.equal(h2.grad, (h1.grad.float() * 3.7).bfloat16())
