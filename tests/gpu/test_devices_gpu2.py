"""Work on a GPU that is not the current device (`plan` times the drafter on the second GPU of
a process whose current device is the first): hand-written Triton kernels launch on the
current device's stream unless told otherwise, so without a device guard they would run on
the wrong GPU, unordered with the work that produced their inputs."""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer.test_loss import reference
from trainer.loss.dflash_loss import IGNORE_INDEX, dflash_loss

pytestmark = [
    pytest.mark.gpu2,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
]


def _inputs(device: torch.device, *, n=64, b=16, d=512, v=16384, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, b, d, generator=g, device=device)
    for _ in range(20):  # queue work on the device, so a kernel racing ahead reads stale data
        hidden = torch.tanh(hidden @ torch.eye(d, device=device) * 1.01)
    weight = torch.randn(v, d, generator=g, device=device) * (2 / math.sqrt(d))
    target = hidden + 0.5 * torch.randn(n, b, d, generator=g, device=device)
    labels = torch.randint(0, v, (n, b), generator=g, device=device)
    best = (hidden.bfloat16().float() @ weight.bfloat16().float().t()).argmax(-1)  # (n, b)
    hit = torch.rand(n, b, generator=g, device=device) < 0.5  # accuracy about one half
    labels = torch.where(hit, best, labels)
    labels[torch.rand(n, b, generator=g, device=device) < 0.2] = IGNORE_INDEX
    return hidden.bfloat16(), weight.bfloat16(), target.bfloat16(), labels


@pytest.mark.parametrize("kernels", ["triton", "compiled"])
def test_loss_on_a_gpu_that_is_not_the_current_device(kernels) -> None:
    torch.cuda.set_device(0)
    device = torch.device("cuda", 1)
    hidden, weight, target, labels = _inputs(device)
    h = hidden.clone().requires_grad_(True)
    out = dflash_loss(
        h, weight, labels, gamma=7.0, target_hidden=target, kl_weight=0.15, cap_weight=0.1,
        chunk_rows=128, kernels=kernels,
    )  # fmt: skip
    out.loss.backward()
    assert torch.cuda.current_device() == 0
    h64 = hidden.double().cpu().requires_grad_(True)
    ref = reference(
        h64, weight.double().cpu(), labels.cpu(), gamma=7.0,
        target_hidden=target.double().cpu(), kl_weight=0.15, cap_weight=0.1,
    )  # fmt: skip
    ref[0].backward()
    for got, want in zip((out.loss, out.ce, out.kl, out.cap), ref, strict=True):
        assert abs(float(got) - float(want)) <= 5e-3 * max(1e-2, abs(float(want)))
    err = (h.grad.double().cpu() - h64.grad).norm() / h64.grad.norm()
    assert float(err) < 3e-2
    logits = h64.detach() @ weight.double().cpu().t()  # (n, b, v), exact
    supervised = labels.cpu() != IGNORE_INDEX
    hits = (logits.argmax(-1) == labels.cpu()) & supervised
    want_acc = hits.sum(0).double() / supervised.sum(0).clamp(min=1)
    got_acc = out.slot_accuracy.cpu().double()
    # The loss takes the argmax of logits rounded to bf16: it may differ from the exact one only
    # in rows whose top two logits are closer than the rounding (2 bf16 steps at the maximum).
    top = logits.topk(2, dim=-1).values
    step = 2.0 ** (torch.floor(torch.log2(top[..., 0].abs().clamp_min(1e-30))) - 7)
    near_tie = ((top[..., 0] - top[..., 1]) < 2 * step) & supervised
    slack = near_tie.sum(0).double() / supervised.sum(0).clamp(min=1)
    seen = supervised.any(0)
    seen[0] = False  # slot 0 (the anchor's own token) is never predicted
    assert ((got_acc - want_acc).abs() <= slack + 1e-9)[seen].all(), (got_acc, want_acc, slack)
