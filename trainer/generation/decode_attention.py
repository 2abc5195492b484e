"""Attention for one decoding step of the static engine (`trainer.generation.decode`): grouped query heads
and only the cache columns written so far.

A step of the static engine hands every layer a boolean mask over the whole `StaticCache`.
With a mask, `transformers`' `sdpa` attention (5.17, for one) copies each key/value head once per
query head sharing it (`repeat_kv`: with 4 query heads per key head, four times the cache bytes
written and read again, every layer, every step), and any version attends over every column,
written or not. Here a step's query (one token per row) is laid out as the key heads' queries
instead — (rows, key heads, query heads per key head, head dim) — so the kernel reads each cached
key and value once, and the mask's width says how many columns the step may read: the engine
passes a mask cut at a multiple of `COLUMN_BLOCK` past the newest column, one CUDA graph per
width, so the unwritten tail of the cache is never read. Any other call (the prefill, a
non-boolean mask) runs `transformers`' own `sdpa` attention unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.model.fidelity import decoder_config

NAME = "dflash_grouped_decode"  # the name the attention registries know this function by
COLUMN_BLOCK = 64  # mask widths are multiples of this: few graphs, aligned masks


def grouped_step_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """`transformers`' attention-function signature: query (b, H, q, d), key and value
    (b, Hk, columns, d), a boolean mask (b, 1, q, width ≤ columns), True where a query attends;
    returns (b, q, H, d). One query per row with a boolean mask: grouped, the first `width`
    columns only. Anything else: `transformers`' `sdpa` attention."""
    if query.shape[2] != 1 or not _plain_boolean(attention_mask, kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    assert attention_mask is not None
    b, heads, _, dim = query.shape
    key_heads, width = key.shape[1], attention_mask.shape[-1]
    grouped = query.reshape(b, key_heads, heads // key_heads, dim)  # query head h reads h // group
    out = F.scaled_dot_product_attention(
        grouped,
        key[:, :, :width],
        value[:, :, :width],
        attn_mask=attention_mask,  # (b, 1, 1, width): the same columns for every head of a row
        dropout_p=dropout,
        scale=scaling,
    )  # (b, Hk, group, d)
    return out.reshape(b, heads, 1, dim).transpose(1, 2).contiguous(), None


def _plain_boolean(mask: torch.Tensor | None, kwargs: dict[str, Any]) -> bool:
    """A 4-D boolean mask and no extra score terms (soft-capping, attention sinks)."""
    extras = any(kwargs.get(k) is not None for k in ("softcap", "s_aux", "sinks", "position_bias"))
    return mask is not None and mask.dtype == torch.bool and mask.dim() == 4 and not extras


def register() -> bool:
    """Make `NAME` known to `transformers`' attention and mask registries (idempotent); False
    where the installed `transformers` has no such registries."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(NAME, grouped_step_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)  # what `sdpa` builds (unused here)
    return True


@contextmanager
def grouped_decoding(model: nn.Module) -> Iterator[bool]:
    """Within: a model whose decoder has `sdpa` attention attends with `grouped_step_attention`
    (yields True: masks may then be cut short); any other model is left as it is (yields
    False). Only the decoder's (text) config is switched, and put back as it was, so the other
    parts of a multimodal model keep their own attention."""
    config: Any = getattr(model, "config", None)
    text = decoder_config(config)
    original = getattr(text, "_attn_implementation", None)
    if (original or "sdpa") != "sdpa" or not register():
        yield False
        return
    text._attn_implementation = NAME
    try:
        yield True
    finally:
        text._attn_implementation = original
