"""draft_attention on the CPU: SDPA path vs naive float64 attention, compiled flex vs SDPA."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.base.errors import (
    AttentionBackendUnavailable,
    AttentionKernelsTooLarge,
    CompileCacheFull,
    DenseAttentionTooLarge,
)
from trainer.model.attention import (
    FlexKernels,
    bucket_length,
    build_draft_mask,
    check_flash_backend,
    compile_errors_as_typed,
    draft_attention,
    flex_kernels,
    kernel_options,
)
from trainer.model.masks import dense_mask
from trainer.settings.config import RunConfig, TrainConfigError


def naive_attention(q, k, v, anchors, valid, s, b, *, window=None, causal=False, scale=None):
    """Per sequence and head, with the dense reference mask; rows that see nothing give 0."""
    bsz, heads, q_len, hd = q.shape
    group = heads // k.shape[1]
    scale = 1 / math.sqrt(hd) if scale is None else scale
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(bsz):
        mask = dense_mask(anchors[i], s, b, window=window, causal_in_block=causal, valid=valid[i])
        for h in range(heads):
            scores = (q[i, h].double() @ k[i, h // group].double().t()) * scale
            scores = scores.masked_fill(~mask, float("-inf"))
            seen = mask.any(-1, keepdim=True)
            probs = torch.softmax(scores.masked_fill(~seen, 0.0), dim=-1) * seen
            out[i, h] = probs @ v[i, h // group].double()
    return out


def layout(seed, bsz, n, s):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randint(0, s, (bsz, n), generator=g), dim=1).values
    valid = torch.rand(bsz, n, generator=g) < 0.75
    valid[0, 1] = False  # at least one invalid block: its rows see nothing
    return anchors, valid


def qkv(seed, bsz, heads, kv_heads, q_len, kv_len, hd, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, heads, q_len, hd, generator=g, dtype=dtype)
    k = torch.randn(bsz, kv_heads, kv_len, hd, generator=g, dtype=dtype)
    v = torch.randn(bsz, kv_heads, kv_len, hd, generator=g, dtype=dtype)
    return q, k, v


@pytest.mark.parametrize("window,causal", [(None, False), (5, True)])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)])
def test_sdpa_matches_naive_values_and_grads(window, causal, heads, kv_heads):
    bsz, n, b, s, hd = 2, 4, 3, 16, 8
    anchors, valid = layout(1, bsz, n, s)
    q, k, v = qkv(2, bsz, heads, kv_heads, n * b, s + n * b, hd, dtype=torch.float64)
    mask = build_draft_mask(
        anchors, valid, s, b, window=window, causal_in_block=causal, backend="sdpa", num_heads=heads
    )
    ours = [t.clone().requires_grad_(True) for t in (q, k, v)]
    refs = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = draft_attention(*ours, mask, scale=0.3)
    ref = naive_attention(*refs, anchors, valid, s, b, window=window, causal=causal, scale=0.3)
    assert out.shape == q.shape
    assert torch.isfinite(out).all()
    assert float((out - ref).norm() / ref.norm()) < 1e-12
    row_invalid = ~valid.repeat_interleave(b, dim=1)  # (Bsz, Q)
    assert float(out.detach().permute(0, 2, 1, 3)[row_invalid].abs().max()) == 0.0
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for a, r in zip(ours, refs, strict=True):
        assert torch.isfinite(a.grad).all()
        assert float((a.grad - r.grad).norm() / r.grad.norm()) < 1e-12


def test_auto_is_sdpa_on_cpu_and_guard_reports_gib():
    anchors, valid = layout(0, 1, 2, 8)
    assert build_draft_mask(anchors, valid, 8, 2).backend == "sdpa"
    # The seed's shape: 32 heads, 2,048 blocks of 16 over 49,152 context positions.
    big = torch.zeros(1, 2048, dtype=torch.long)
    with pytest.raises(DenseAttentionTooLarge, match=r"\d+\.\d+ GiB") as err:
        build_draft_mask(
            big, torch.ones_like(big, dtype=torch.bool), 49152, 16, backend="sdpa", num_heads=32
        )
    assert err.value.needed_gib > 300


def test_eager_flex_is_refused_beyond_the_budget():
    eager = flex_kernels(compiled=False)
    assert isinstance(eager, FlexKernels) and not eager.compiled
    anchors = torch.zeros(1, 2048, dtype=torch.long)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    with pytest.raises(DenseAttentionTooLarge, match="without torch.compile") as err:
        build_draft_mask(anchors, valid, 49152, 16, backend="flex", num_heads=32, kernels=eager)
    assert err.value.needed_gib > 300


def test_shape_mismatch_is_refused():
    anchors, valid = layout(0, 2, 2, 8)
    mask = build_draft_mask(anchors, valid, 8, 2, backend="sdpa")
    q, k, v = qkv(0, 2, 2, 2, 4, 11, 4)
    with pytest.raises(ValueError, match="kv length"):
        draft_attention(q, k, v, mask)


@pytest.mark.slow
def test_compiled_flex_forward_matches_sdpa_on_cpu():
    """Compiled FlexAttention on the CPU (inference only) against SDPA with the dense mask."""
    try:
        kernels = flex_kernels()
    except Exception as exc:  # pragma: no cover - depends on the local toolchain
        pytest.skip(f"torch.compile unavailable: {exc}")
    bsz, n, b, s, hd, heads, kv_heads = 2, 5, 4, 128, 16, 4, 2
    anchors, valid = layout(3, bsz, n, s)
    q, k, v = qkv(4, bsz, heads, kv_heads, n * b, s + n * b, hd)
    sdpa = draft_attention(
        q,
        k,
        v,
        build_draft_mask(anchors, valid, s, b, window=40, causal_in_block=True, backend="sdpa"),
    )
    with torch.no_grad():
        try:
            mask = build_draft_mask(
                anchors,
                valid,
                s,
                b,
                window=40,
                causal_in_block=True,
                backend="flex",
                kernels=kernels,
            )
            flex = draft_attention(q, k, v, mask)
        except AttentionBackendUnavailable:
            raise
        except Exception as exc:  # pragma: no cover - no C++ compiler, etc.
            pytest.skip(f"compiled flex_attention does not run here: {exc}")
    assert torch.isfinite(flex).all()
    assert float((flex - sdpa).norm() / sdpa.norm()) < 1e-5
    with pytest.raises(AttentionBackendUnavailable):
        draft_attention(q.requires_grad_(True), k, v, mask)


@pytest.mark.slow
def test_a_full_compile_cache_fails_loudly_instead_of_running_eager():
    """Past dynamo's recompile limit the mask builder must raise, not silently go eager."""
    config = torch._dynamo.config
    torch._dynamo.reset()
    flex_kernels.cache_clear()
    # the outer patch puts back whatever the kernels' creation changes, for the tests after
    with config.patch(
        recompile_limit=config.recompile_limit,
        fail_on_recompile_limit_hit=config.fail_on_recompile_limit_hit,
    ):
        try:
            kernels = flex_kernels()
            assert config.fail_on_recompile_limit_hit
            assert config.recompile_limit >= 64
            anchors, valid = layout(5, 2, 4, 128)
            with config.patch(recompile_limit=1):
                try:
                    build_draft_mask(anchors, valid, 128, 4, backend="flex", kernels=kernels)
                except Exception as exc:  # pragma: no cover - no C++ compiler, etc.
                    pytest.skip(f"compiled create_block_mask does not run here: {exc}")
                with pytest.raises(CompileCacheFull, match="more than 1 distinct shapes") as info:
                    build_draft_mask(anchors, valid, 256, 4, backend="flex", kernels=kernels)
            assert "data.bucket" in str(info.value)
        finally:
            torch._dynamo.reset()
            flex_kernels.cache_clear()


def test_bucket_length_rounds_up_to_the_tile():
    assert [bucket_length(x) for x in (0, 1, 128, 129, 300)] == [0, 128, 128, 256, 384]
    assert bucket_length(10, multiple=16) == 16


def test_kernel_options_refuse_an_unknown_preset_and_are_none_on_the_cpu():
    with pytest.raises(ValueError, match="auto"):
        kernel_options(torch.device("cpu"), "tiny")
    assert kernel_options(torch.device("cpu"), "small") is None
    with pytest.raises(TrainConfigError, match="run.attention_kernels"):
        RunConfig(attention_kernels="huge")


def test_flash_kernels_are_refused_with_what_to_do_where_they_cannot_run():
    """Before Hopper the message names the GPU; without flash-attn-4 it names the packages."""
    with pytest.raises(AttentionBackendUnavailable, match="compute capability 9.0") as old:
        check_flash_backend((8, 9))
    assert 'run.attention_kernels = "auto"' in old.value.hint
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        with pytest.raises(AttentionBackendUnavailable, match="flash-attn-4") as missing:
            check_flash_backend((9, 0))
        assert "pip install flash-attn-4 nvidia-cutlass-dsl" in missing.value.hint
    else:
        check_flash_backend((9, 0))
    assert RunConfig(attention_kernels="flash").attention_kernels == "flash"


def test_out_of_resource_compile_errors_name_the_setting_that_fixes_them():
    """Triton's message, however deep inductor wraps it, becomes one typed error with the fix."""
    triton_line = (
        "out of resource: shared memory, Required: 166400, Hardware limit: 101376. "
        "Reducing block sizes or `num_stages` may help."
    )
    with pytest.raises(AttentionKernelsTooLarge) as caught, compile_errors_as_typed("A layer"):
        try:
            raise RuntimeError(triton_line)
        except RuntimeError as inner:
            raise RuntimeError("backend compiler failed") from inner
    assert "Hardware limit: 101376" in str(caught.value)
    assert 'run.attention_kernels = "small"' in caught.value.hint
    with pytest.raises(KeyError), compile_errors_as_typed("A layer"):  # others pass untouched
        raise KeyError("unrelated")
