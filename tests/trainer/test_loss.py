"""dflash_loss against a plain float64 implementation: full logits, loops, autograd."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss.dflash_loss import IGNORE_INDEX, dflash_loss


def reference(hidden, weight, labels, *, gamma, target_hidden=None, kl_weight=0.0, cap_weight=0.0):
    """The definition, written out: every term from full float64 logits, one row at a time."""
    n_blocks, b, _ = hidden.shape
    logq = torch.log_softmax(hidden.double() @ weight.double().t(), dim=-1)  # (N, B, V)
    logp = None
    if target_hidden is not None:
        logp = torch.log_softmax(target_hidden.double() @ weight.double().t(), dim=-1)
    zero = hidden.new_zeros((), dtype=torch.float64)
    w_sum, ce, kl = zero, zero, zero
    for n in range(n_blocks):
        for k in range(1, b):
            y = int(labels[n, k])
            if y == IGNORE_INDEX:
                continue
            w = math.exp(-(k - 1) / gamma)
            w_sum = w_sum + w
            ce = ce - w * logq[n, k, y]
            if logp is not None:
                kl = kl + w * (logp[n, k].exp() * (logp[n, k] - logq[n, k])).sum()
    if w_sum > 0:
        ce, kl = ce / w_sum, kl / w_sum
    blocks, cap = 0, zero
    for n in range(n_blocks):
        if b < 2 or int(labels[n, 1]) == IGNORE_INDEX:
            continue
        blocks += 1
        acc, prod = zero, 1.0
        for m in range(1, b):
            y = int(labels[n, m])
            prod = prod * (0.0 if y == IGNORE_INDEX else logq[n, m, y].exp())
            acc = acc + prod
        cap = cap - acc / (b - 1)
    if blocks:
        cap = cap / blocks
    loss = (1 - kl_weight) * ce + kl_weight * kl + cap_weight * cap
    return loss, ce, kl, cap


def make(n=5, b=4, d=12, v=40, *, seed=0, dtype=torch.float64, ignore=0.25):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, b, d, generator=g, dtype=dtype)
    weight = torch.randn(v, d, generator=g, dtype=dtype) / math.sqrt(d) * 3
    target = hidden + 0.5 * torch.randn(n, b, d, generator=g, dtype=dtype)
    labels = torch.randint(0, v, (n, b), generator=g)
    labels[torch.rand(n, b, generator=g) < ignore] = IGNORE_INDEX
    return hidden, weight, target, labels


def rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


CASES = [
    dict(kl_weight=0.0, cap_weight=0.0),
    dict(kl_weight=1.0, cap_weight=0.0),
    dict(kl_weight=0.0, cap_weight=1.0),
    dict(kl_weight=0.15, cap_weight=0.3),
]


@pytest.mark.parametrize("weights", CASES, ids=["ce", "kl", "ce+cap", "all"])
@pytest.mark.parametrize("chunk_rows", [4, 8, 12, 1000], ids=lambda c: f"chunk{c}")
def test_matches_reference_values_and_hidden_grad(weights, chunk_rows):
    hidden, weight, target, labels = make()
    labels[1, 2] = IGNORE_INDEX  # an ignored slot mid-block breaks cap's chain
    labels[1, 1] = 3
    labels[2, 1] = IGNORE_INDEX  # a block that cap leaves out
    h_ours = hidden.clone().requires_grad_(True)
    h_ref = hidden.clone().requires_grad_(True)
    t = target if weights["kl_weight"] > 0 else None
    out = dflash_loss(
        h_ours, weight, labels, gamma=3.0, target_hidden=t, chunk_rows=chunk_rows, **weights
    )
    ref = reference(h_ref, weight, labels, gamma=3.0, target_hidden=t, **weights)
    for got, want in zip((out.loss, out.ce, out.kl, out.cap), ref, strict=True):
        assert got.shape == ()
        assert abs(float(got) - float(want)) <= 1e-10 * max(1.0, abs(float(want)))
    out.loss.backward()
    ref[0].backward()
    assert rel(h_ours.grad, h_ref.grad) < 1e-10


@pytest.mark.parametrize("kl_weight", [0.0, 0.4])
def test_weight_grad_when_weight_trains(kl_weight):
    hidden, weight, target, labels = make(seed=1)
    w_ours = weight.clone().requires_grad_(True)
    w_ref = weight.clone().requires_grad_(True)
    t_ours = target.clone().requires_grad_(True)
    out = dflash_loss(
        hidden,
        w_ours,
        labels,
        gamma=2.0,
        target_hidden=t_ours,
        kl_weight=kl_weight,
        cap_weight=0.5,
        chunk_rows=8,
    )
    ref = reference(
        hidden, w_ref, labels, gamma=2.0, target_hidden=target, kl_weight=kl_weight, cap_weight=0.5
    )
    out.loss.backward()
    ref[0].backward()
    assert rel(w_ours.grad, w_ref.grad) < 1e-10
    assert t_ours.grad is None  # the target's hidden states are a constant


def test_frozen_weight_gets_no_grad_and_float32_is_close():
    hidden, weight, target, labels = make(seed=2, dtype=torch.float32, n=7, b=5, v=64)
    h = hidden.clone().requires_grad_(True)
    out = dflash_loss(
        h,
        weight,
        labels,
        gamma=5.0,
        target_hidden=target,
        kl_weight=0.2,
        cap_weight=0.1,
        chunk_rows=10,
    )
    out.loss.backward()
    assert weight.grad is None and not weight.requires_grad
    assert out.loss.dtype == torch.float32
    h64 = hidden.double().requires_grad_(True)
    ref = reference(
        h64,
        weight.double(),
        labels,
        gamma=5.0,
        target_hidden=target.double(),
        kl_weight=0.2,
        cap_weight=0.1,
    )
    ref[0].backward()
    assert abs(float(out.loss) - float(ref[0])) < 1e-5 * max(1.0, abs(float(ref[0])))
    assert rel(h.grad.double(), h64.grad) < 1e-5


def test_grad_output_scales_gradient():
    hidden, weight, _, labels = make(seed=3)
    h1 = hidden.clone().requires_grad_(True)
    h2 = hidden.clone().requires_grad_(True)
    dflash_loss(h1, weight, labels, gamma=4.0, cap_weight=0.2).loss.backward()
    (dflash_loss(h2, weight, labels, gamma=4.0, cap_weight=0.2).loss * -2.5).backward()
    assert rel(h2.grad, -2.5 * h1.grad) < 1e-12


def test_grad_output_scales_a_bf16_gradient_in_float32():
    """The scale is a tensor (reading it would wait for the device) but is applied in float32,
    never rounded to bf16 first (3.7 would become 3.703125)."""
    hidden, weight, _, labels = make(seed=4, dtype=torch.bfloat16, n=6, b=4, d=16, v=48)
    h1 = hidden.clone().requires_grad_(True)
    h2 = hidden.clone().requires_grad_(True)
    dflash_loss(h1, weight, labels, gamma=4.0).loss.backward()
    (dflash_loss(h2, weight, labels, gamma=4.0).loss * 3.7).backward()
    assert h2.grad.dtype == torch.bfloat16
    assert torch.equal(h2.grad, (h1.grad.float() * torch.tensor(3.7)).bfloat16())


def test_all_ignored_is_zero_with_a_gradient_path():
    hidden, weight, target, labels = make(seed=4)
    labels[:] = IGNORE_INDEX
    h = hidden.clone().requires_grad_(True)
    out = dflash_loss(
        h, weight, labels, gamma=3.0, target_hidden=target, kl_weight=0.5, cap_weight=1.0
    )
    assert out.loss.requires_grad
    for term in (out.loss, out.ce, out.kl, out.cap):
        assert float(term) == 0.0
    out.loss.backward()
    assert torch.equal(h.grad, torch.zeros_like(h))
    assert torch.isnan(out.slot_accuracy).all()


def test_slot_accuracy_counts_argmax_hits_per_slot():
    hidden, weight, _, labels = make(seed=5, n=30, b=3, v=6, ignore=0.2)
    logits = hidden @ weight.t()
    labels[:10, 2] = logits[:10, 2].argmax(-1)  # make some hits certain
    out = dflash_loss(hidden, weight, labels, gamma=3.0, chunk_rows=6)
    assert out.slot_accuracy.shape == (3,)
    assert torch.isnan(out.slot_accuracy[0])  # slot 0 is never supervised
    for k in (1, 2):
        keep = labels[:, k] != IGNORE_INDEX
        want = (logits[:, k].argmax(-1) == labels[:, k])[keep].double().mean()
        assert abs(float(out.slot_accuracy[k]) - float(want)) < 1e-12


def test_slot_zero_label_is_ignored():
    hidden, weight, _, labels = make(seed=6)
    other = labels.clone()
    other[:, 0] = (labels[:, 0].clamp_min(0) + 1) % weight.shape[0]
    a = dflash_loss(hidden, weight, labels, gamma=3.0, cap_weight=1.0)
    b = dflash_loss(hidden, weight, other, gamma=3.0, cap_weight=1.0)
    assert float(a.loss) == float(b.loss)


def test_kl_without_target_is_refused():
    hidden, weight, _, labels = make()
    with pytest.raises(ValueError, match="target_hidden"):
        dflash_loss(hidden, weight, labels, gamma=3.0, kl_weight=0.1)


def test_no_grad_inputs_compute_values_only():
    hidden, weight, target, labels = make(seed=7)
    with torch.no_grad():
        out = dflash_loss(
            hidden.requires_grad_(True),
            weight,
            labels,
            gamma=3.0,
            target_hidden=target,
            kl_weight=0.3,
        )
    assert not out.loss.requires_grad
    ref = reference(hidden.detach(), weight, labels, gamma=3.0, target_hidden=target, kl_weight=0.3)
    assert abs(float(out.loss) - float(ref[0])) < 1e-10


@pytest.mark.slow
def test_compiled_chunk_kernels_match_reference():
    """The torch.compile'd per-chunk functions (a CUDA fallback) against the definition,
    with the weight trainable so that every compiled function runs."""
    hidden, weight, target, labels = make(seed=8, dtype=torch.float32, n=6, b=4, v=48)
    h = hidden.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    out = dflash_loss(
        h,
        w,
        labels,
        gamma=3.0,
        target_hidden=target,
        kl_weight=0.3,
        cap_weight=0.5,
        chunk_rows=8,
        kernels="compiled",
    )
    out.loss.backward()
    h64 = hidden.double().requires_grad_(True)
    w64 = weight.double().requires_grad_(True)
    ref = reference(
        h64,
        w64,
        labels,
        gamma=3.0,
        target_hidden=target.double(),
        kl_weight=0.3,
        cap_weight=0.5,
    )
    ref[0].backward()
    for got, want in zip((out.loss, out.ce, out.kl, out.cap), ref, strict=True):
        assert abs(float(got) - float(want)) < 1e-5 * max(1.0, abs(float(want)))
    assert rel(h.grad.double(), h64.grad) < 1e-5
    assert rel(w.grad.double(), w64.grad) < 1e-5


@pytest.mark.parametrize("weights", CASES, ids=["ce", "kl", "ce+cap", "all"])
def test_parts_with_the_batch_norms_add_up_to_the_batch(weights):
    """Gradient accumulation: each part's loss over the whole batch's W and C; the parts'
    losses, terms and gradients sum to the reference of the whole batch."""
    from trainer.loss.dflash_loss import loss_norms

    hidden, weight, target, labels = make(n=9, seed=4)
    labels[4, 1] = IGNORE_INDEX  # a block that cap leaves out
    labels[6:8] = IGNORE_INDEX  # a part with nothing supervised in places
    h_parts = hidden.clone().requires_grad_(True)
    h_ref = hidden.clone().requires_grad_(True)
    t = target if weights["kl_weight"] > 0 else None
    norms = loss_norms(labels, 3.0, hidden.dtype)
    totals = [0.0, 0.0, 0.0, 0.0]
    for rows in (slice(0, 2), slice(2, 6), slice(6, 9)):
        out = dflash_loss(
            h_parts[rows],
            weight,
            labels[rows],
            gamma=3.0,
            target_hidden=None if t is None else t[rows],
            chunk_rows=8,
            norms=norms,
            **weights,
        )
        out.loss.backward()
        for i, term in enumerate((out.loss, out.ce, out.kl, out.cap)):
            totals[i] += float(term)
    ref = reference(h_ref, weight, labels, gamma=3.0, target_hidden=t, **weights)
    for got, want in zip(totals, ref, strict=True):
        assert abs(got - float(want)) <= 1e-10 * max(1.0, abs(float(want)))
    ref[0].backward()
    assert rel(h_parts.grad, h_ref.grad) < 1e-10
    # without the batch's norms each part would be its own mean: not the batch's loss
    alone = sum(
        float(dflash_loss(hidden[r], weight, labels[r], gamma=3.0, chunk_rows=8).loss)
        for r in (slice(0, 2), slice(2, 6), slice(6, 9))
    )
    assert abs(alone - float(reference(hidden, weight, labels, gamma=3.0)[0])) > 1e-3
