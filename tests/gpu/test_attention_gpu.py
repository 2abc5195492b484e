"""Compiled FlexAttention on CUDA: forward and backward against SDPA with the dense mask (full
and sliding-window layers, the window as the engines serve it), the compiled BlockMask's mask_mod
against the dense mask cell for cell, and peak memory at the seed's attention shape (run with
`pytest tests/gpu`)."""

from __future__ import annotations

import pytest
import torch

from trainer.model.attention import (
    FLASH_KERNEL_OPTIONS,
    SMALL_KERNEL_OPTIONS,
    build_draft_mask,
    draft_attention,
    flex_kernels,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

GIB = float(1 << 30)
RAW_FLEX_PEAK_GIB = 1.76  # anchors/h200.md: compiled flex fwd+bwd at 32,768 × 81,920


def flash_installed() -> bool:
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


FLASH = pytest.param(
    "flash",
    marks=pytest.mark.skipif(not flash_installed(), reason="needs flash-attn-4 on Hopper+"),
)


def layout(seed, bsz, n, s, *, invalid=0.1):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randint(1, s, (bsz, n), generator=g), dim=1).values
    valid = torch.rand(bsz, n, generator=g) >= invalid
    if invalid > 0:
        valid[0, 1] = False  # at least one block whose rows see nothing
    return anchors.cuda(), valid.cuda()


def inputs(seed, bsz, heads, kv_heads, q_len, kv_len, hd):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape_q, shape_kv = (bsz, heads, q_len, hd), (bsz, kv_heads, kv_len, hd)
    q = torch.randn(shape_q, generator=g, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(shape_kv, generator=g, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape_kv, generator=g, device="cuda", dtype=torch.bfloat16)
    return q, k, v


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def run(q, k, v, mask, grad):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out = draft_attention(*leaves, mask)
    out.backward(grad)
    return out.detach(), [t.grad for t in leaves]


SHAPES = {
    # bsz, blocks, block size, context, heads, kv heads, head dim
    "small": (2, 8, 16, 256, 4, 2, 64),
    "mid": (2, 128, 16, 2048, 8, 2, 128),
    "mha": (2, 32, 16, 512, 4, 4, 64),  # a drafter with model.num_kv_heads = its heads
}


@pytest.mark.parametrize("name", list(SHAPES))
# windows: the served per-slot rule (slot k sees positions ≥ anchor + k − (W − 1)) with W
# shorter than a block (the bound cuts into the block too), a little longer, and long.
@pytest.mark.parametrize("window,causal", [(None, False), (7, True), (40, True), (512, True)])
@pytest.mark.parametrize("preset", ["auto", "small", FLASH])
def test_compiled_flex_matches_sdpa_forward_and_backward(name, window, causal, preset):
    """Every kernel preset: the device's own, the tiles that fit ~100 KiB GPUs (forced), and
    the CuTe-DSL backend where flash-attn-4 is installed."""
    bsz, n, b, s, heads, kv_heads, hd = SHAPES[name]
    anchors, valid = layout(0, bsz, n, s)
    q, k, v = inputs(1, bsz, heads, kv_heads, n * b, s + n * b, hd)
    grad = torch.randn_like(q)
    opts = dict(window=window, causal_in_block=causal, num_heads=heads)
    flex_mask = build_draft_mask(anchors, valid, s, b, backend="flex", kernel_preset=preset, **opts)
    assert (flex_mask.options == SMALL_KERNEL_OPTIONS) == (preset == "small")
    assert (flex_mask.options == FLASH_KERNEL_OPTIONS) == (preset == "flash")
    sdpa_mask = build_draft_mask(anchors, valid, s, b, backend="sdpa", dense_budget_gib=64, **opts)

    flex_out, flex_grads = run(q, k, v, flex_mask, grad)
    # The reference: SDPA with the dense mask in fp32 on the same bf16 values.
    ref_out, ref_grads = run(q.float(), k.float(), v.float(), sdpa_mask, grad.float())
    bf16_out, bf16_grads = run(q, k, v, sdpa_mask, grad)

    assert torch.isfinite(flex_out).all()
    rows_invalid = ~valid.repeat_interleave(b, dim=1)  # (Bsz, Q)
    assert float(flex_out.transpose(1, 2)[rows_invalid].abs().max()) == 0.0
    assert rel(flex_out, ref_out) < 1e-2
    # flex in bf16 is about as close to the fp32 reference as SDPA in bf16 is.
    assert rel(flex_out, ref_out) < 3 * rel(bf16_out, ref_out) + 1e-3
    for got, want, base in zip(flex_grads, ref_grads, bf16_grads, strict=True):
        assert torch.isfinite(got).all()
        assert rel(got, want) < 2e-2
        assert rel(got, want) < 3 * rel(base, want) + 2e-3


@pytest.mark.parametrize("window", [7, 40])
def test_sliding_mask_mod_on_cuda_equals_the_dense_mask(window):
    """The mask_mod evaluated on the GPU (as the compiled BlockMask builder evaluates it) equals
    `batched_dense_mask` cell for cell, per-slot window and causal block included."""
    from torch.nn.attention.flex_attention import create_mask

    from trainer.model.masks import batched_dense_mask, draft_mask_mod

    bsz, n, b, s = 2, 8, 16, 256
    anchors, valid = layout(4, bsz, n, s)
    mod = draft_mask_mod(anchors, valid, s, b, window=window, causal_in_block=True)
    got = create_mask(mod, bsz, None, n * b, s + n * b, device="cuda")[:, 0]
    want = batched_dense_mask(anchors, s, b, window=window, causal_in_block=True, valid=valid)
    assert torch.equal(got, want)


def test_seed_shape_peak_memory():
    """32 heads, head dim 128, 2,048 blocks × 16 queries over 49,152 context positions."""
    bsz, n, b, s, heads, hd = 1, 2048, 16, 49152, 32, 128
    anchors, valid = layout(2, bsz, n, s, invalid=0.0)
    q, k, v = inputs(3, bsz, heads, heads, n * b, s + n * b, hd)
    mask = build_draft_mask(anchors, valid, s, b, backend="flex", num_heads=heads)
    leaves = [t.requires_grad_(True) for t in (q, k, v)]
    grad = torch.randn_like(q)

    def step():
        for t in leaves:
            t.grad = None
        draft_attention(*leaves, mask).backward(grad)

    step()  # compile and warm up
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    draft_attention(*leaves, mask).backward(grad)
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - before) / GIB
    assert peak <= 2 * RAW_FLEX_PEAK_GIB, f"fwd+bwd peak {peak:.2f} GiB"
    assert all(torch.isfinite(t.grad).all() for t in leaves)


def test_block_mask_is_built_per_batch_not_per_head():
    anchors, valid = layout(4, 2, 16, 1024)
    mask = build_draft_mask(anchors, valid, 1024, 16, backend="flex", num_heads=32)
    assert mask.block_mask is not None
    assert mask.block_mask.kv_num_blocks.shape[:2] == (2, 1)
    assert mask.kernels is flex_kernels()


def test_new_batch_does_not_recompile():
    """A new batch (new anchors, same bucketed shapes) reuses the compiled mask builder and kernel."""
    bsz, n, b, s, heads, hd = 2, 32, 16, 1024, 4, 64
    q, k, v = inputs(5, bsz, heads, heads, n * b, s + n * b, hd)
    anchors, valid = layout(6, bsz, n, s)
    draft_attention(q, k, v, build_draft_mask(anchors, valid, s, b, backend="flex"))  # compiles
    for seed in (7, 8):
        anchors, valid = layout(seed, bsz, n, s)
        with torch.compiler.set_stance("fail_on_recompile"):
            mask = build_draft_mask(anchors, valid, s, b, backend="flex")
            out = draft_attention(q, k, v, mask)
        ref_mask = build_draft_mask(anchors, valid, s, b, backend="sdpa")
        assert rel(out, draft_attention(q.float(), k.float(), v.float(), ref_mask)) < 1e-2


@pytest.mark.parametrize("window", [7, 40])
def test_drafter_with_served_window_flex_matches_sdpa(window):
    """A whole drafter for a Llama-shaped target (q/k norm, attention bias, llama3 rope, one
    sliding layer): compiled flex against SDPA with the dense mask, outputs and gradients, fp32."""
    from transformers import LlamaConfig

    from trainer.model.drafter import Drafter, shape_from_target
    from trainer.settings.config import ModelConfig

    hidden, vocab, s, n, b = 128, 500, 256, 8, 16
    target = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=256, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
        max_position_embeddings=4096, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
    )  # fmt: skip
    model = ModelConfig(
        target="t", num_layers=2, block_size=b, sliding_window=window, sliding_layers=[0]
    )
    torch.manual_seed(0)
    drafter = Drafter(shape_from_target(target, model, num_features=2)).cuda()
    anchors, valid = layout(5, 2, n, s)
    g = torch.Generator().manual_seed(6)
    features = torch.randn(2, s, 2 * hidden, generator=g).cuda()
    ids = torch.randint(0, vocab, (2, s), generator=g).cuda()
    embed = torch.randn(vocab, hidden, generator=g).cuda()
    cotangent = torch.randn(2, n, b, hidden, generator=g).cuda()
    results = []
    for backend in ("flex", "sdpa"):
        drafter.zero_grad(set_to_none=True)
        drafter.attention_backend = backend
        feats = features.clone().requires_grad_()
        out = drafter(feats, ids, anchors, valid, embed)
        out.backward(cotangent)  # random: after the final norm out.square().mean() is ~constant
        results.append([out.detach(), feats.grad] + [p.grad for p in drafter.parameters()])
    for got, want in zip(*results, strict=True):
        assert rel(got, want) < 1e-4
