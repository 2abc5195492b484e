"""The static engine's step attention (`trainer.generation.decode_attention`) against attention written out
in float64 with every key head repeated for its query heads: values and gradients, masks with
holes, a cache whose unwritten tail is NaN (never read); a multimodal model's decoder alone is
switched to it. Decoding through it: `tests/trainer/test_generate.py`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.generation.decode_attention import NAME, grouped_decoding, grouped_step_attention


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """(b, 1, H, d) in float64: each key/value head repeated for its group, masked softmax."""
    group, width = q.shape[1] // k.shape[1], mask.shape[-1]
    k = k[:, :, :width].double().repeat_interleave(group, dim=1)
    v = v[:, :, :width].double().repeat_interleave(group, dim=1)
    scores = (q.double() @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5  # (b, H, 1, width)
    scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


def inputs(seed: int, *, heads: int = 8, key_heads: int = 2, columns: int = 96, width: int = 64):
    gen = torch.Generator().manual_seed(seed)
    b, d = 5, 16
    q = torch.randn(b, heads, 1, d, generator=gen)
    k = torch.randn(b, key_heads, columns, d, generator=gen)
    v = torch.randn(b, key_heads, columns, d, generator=gen)
    k[:, :, width:] = float("nan")  # the cache's unwritten tail: reading it would spread NaN
    v[:, :, width:] = float("nan")
    mask = torch.rand(b, 1, 1, width, generator=gen) < 0.7  # holes: padding, unopened columns
    mask[:, :, :, 0] = True  # every row attends somewhere
    return q, k, v, mask


@pytest.mark.parametrize(("heads", "key_heads"), [(8, 2), (6, 6), (4, 1)])
def test_grouped_step_attention_equals_repeated_heads(heads: int, key_heads: int) -> None:
    q, k, v, mask = inputs(heads, heads=heads, key_heads=key_heads)
    got, _ = grouped_step_attention(nn.Identity(), q, k, v, mask, scaling=q.shape[-1] ** -0.5)
    want = reference(q, k, v, mask)
    assert got.shape == want.shape == (5, 1, heads, 16)
    assert (got.double() - want).norm() <= 1e-5 * want.norm()


def test_grouped_step_attention_gradients_equal_the_reference() -> None:
    q, k, v, mask = inputs(1)
    k, v = k.nan_to_num(0.0), v.nan_to_num(0.0)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_leaves = [t.clone().double().requires_grad_() for t in (q, k, v)]
    weights = torch.randn(5, 1, 8, 16, generator=torch.Generator().manual_seed(2))
    got, _ = grouped_step_attention(nn.Identity(), *leaves, mask, scaling=16**-0.5)
    (got * weights).sum().backward()
    (reference(*ref_leaves, mask) * weights.double()).sum().backward()
    for mine, theirs in zip(leaves, ref_leaves, strict=True):
        assert mine.grad is not None and theirs.grad is not None
        assert (mine.grad.double() - theirs.grad).norm() <= 1e-5 * theirs.grad.norm()
    assert not leaves[1].grad[:, :, 64:].any()  # columns past the mask: not read, no gradient


def test_grouped_decoding_switches_only_the_decoder_of_a_multimodal_model() -> None:
    """A vision encoder keeps its own attention while the text decoder attends grouped, and
    both are as they were afterwards."""
    pytest.importorskip("transformers.models.qwen3_vl", reason="transformers without Qwen3-VL")
    from transformers import AutoConfig

    model = nn.Module()
    model.config = AutoConfig.for_model("qwen3_vl")
    model.config._attn_implementation = {
        "": "sdpa",
        "text_config": "sdpa",
        "vision_config": "eager",
    }
    text, vision = model.config.text_config, model.config.vision_config
    with grouped_decoding(model) as grouped:
        assert grouped
        assert (text._attn_implementation, vision._attn_implementation) == (NAME, "eager")
    assert (text._attn_implementation, vision._attn_implementation) == ("sdpa", "eager")
