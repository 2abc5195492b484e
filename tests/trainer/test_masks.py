"""The DFlash mask: hand-written cases for dense_mask, and the flex mask_mod against it."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from trainer.model.masks import batched_dense_mask, dense_mask, draft_mask_mod


def rows(*lines: str) -> torch.Tensor:
    """A mask written as strings of 0/1, one per query row (spaces are ignored)."""
    return torch.tensor([[c == "1" for c in line.replace(" ", "")] for line in lines])


def test_two_blocks_bidirectional():
    # S = 5, B = 2, anchors 2 and 4: keys are [c0 c1 c2 c3 c4 | b0s0 b0s1 | b1s0 b1s1].
    want = rows(
        "11000 11 00",
        "11000 11 00",
        "11110 00 11",
        "11110 00 11",
    )
    got = dense_mask(torch.tensor([2, 4]), 5, 2)
    assert torch.equal(got, want)


def test_window_and_causal_in_block():
    # S = 6, B = 3, anchors 1 and 5, window 2 (the engines' rule: slot k at position a + k sees
    # positions a + k − 1 and a + k): slot 0 sees the context token just before its anchor and
    # itself; later slots see the previous slot and themselves, no context.
    want = rows(
        "100000 100 000",
        "000000 110 000",
        "000000 011 000",
        "000010 000 100",
        "000000 000 110",
        "000000 000 011",
    )
    got = dense_mask(torch.tensor([1, 5]), 6, 3, window=2, causal_in_block=True)
    assert torch.equal(got, want)


def sliding_rule(anchor: int, slot: int, key_pos: int, window: int) -> bool:
    """The serving engines' sliding-window layer, written per position: the query at position
    anchor + slot sees every position p with anchor + slot − (W − 1) <= p <= anchor + slot that it
    has (context positions < anchor, block slots 0 … slot)."""
    q_pos = anchor + slot
    return q_pos - (window - 1) <= key_pos <= q_pos


@pytest.mark.parametrize("window", [1, 3, 6, 40])
def test_window_is_the_engines_per_slot_rule(window: int) -> None:
    s, b = 30, 5
    anchors = torch.tensor([0, 3, 12, 29])
    got = dense_mask(anchors, s, b, window=window, causal_in_block=True)
    mod = draft_mask_mod(
        anchors[None], torch.ones(1, 4, dtype=torch.bool), s, b, window=window, causal_in_block=True
    )
    flex = create_mask(mod, 1, None, 4 * b, s + 4 * b, device="cpu")[0, 0]
    want = torch.zeros_like(got)
    for n, a in enumerate(anchors.tolist()):
        for k in range(b):
            for j in range(a):  # context positions before the anchor
                want[n * b + k, j] = sliding_rule(a, k, j, window)
            for k2 in range(b):  # own block: slot k2 is at position a + k2
                want[n * b + k, s + n * b + k2] = sliding_rule(a, k, a + k2, window)
    assert torch.equal(got, want)
    assert torch.equal(flex, want)


def test_invalid_block_and_anchor_at_zero():
    # S = 4, B = 2, anchors 0, 3, 3 with the middle block invalid: block 0 sees no context,
    # block 1 sees nothing at all, block 2 sees context 0..2 and itself.
    want = rows(
        "0000 11 00 00",
        "0000 11 00 00",
        "0000 00 00 00",
        "0000 00 00 00",
        "1110 00 00 11",
        "1110 00 00 11",
    )
    got = dense_mask(torch.tensor([0, 3, 3]), 4, 2, valid=torch.tensor([True, False, True]))
    assert torch.equal(got, want)


def test_batched_rows_equal_the_single_sequence_mask():
    anchors = torch.tensor([[1, 4, 9], [0, 2, 3]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    batch = batched_dense_mask(anchors, 10, 4, window=3, valid=valid)
    for i in range(2):
        assert torch.equal(batch[i], dense_mask(anchors[i], 10, 4, window=3, valid=valid[i]))


def random_layout(seed: int, bsz: int, n: int, s: int):
    g = torch.Generator().manual_seed(seed)
    anchors = torch.sort(torch.randint(0, s, (bsz, n), generator=g), dim=1).values
    valid = torch.rand(bsz, n, generator=g) < 0.8
    return anchors, valid


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block_size", [1, 4, 5])
def test_mask_mod_agrees_with_dense_mask(window, causal, block_size):
    bsz, n, s = 3, 6, 37
    anchors, valid = random_layout(block_size, bsz, n, s)
    mod = draft_mask_mod(anchors, valid, s, block_size, window=window, causal_in_block=causal)
    q_len, kv_len = n * block_size, s + n * block_size
    got = create_mask(mod, bsz, None, q_len, kv_len, device="cpu")[:, 0]  # (Bsz, Q, K)
    for i in range(bsz):
        want = dense_mask(
            anchors[i], s, block_size, window=window, causal_in_block=causal, valid=valid[i]
        )
        assert torch.equal(got[i], want)


@pytest.mark.parametrize("tile,block_size", [(128, 4), (256, 4), (256, 5)])
def test_mask_mod_is_safe_on_padded_query_rows(tile, block_size):
    """The kernels evaluate whole query tiles (Triton 128 rows, the CuTe-DSL backend up to 256):
    rows past N·B index the padded block tensors safely and see nothing."""
    n, s = 3, 20
    anchors, valid = random_layout(0, 2, n, s)
    mod = draft_mask_mod(anchors, valid, s, block_size)
    got = create_mask(mod, 2, None, tile, tile + s, device="cpu")
    assert got.shape == (2, 1, tile, tile + s)
    assert not got[:, :, n * block_size :].any()
    real = create_mask(mod, 2, None, n * block_size, s + n * block_size, device="cpu")
    assert torch.equal(got[:, :, : n * block_size, : s + n * block_size], real)


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="valid"):
        dense_mask(torch.tensor([1, 2]), 4, 2, valid=torch.tensor([True]))
    with pytest.raises(ValueError, match="1-D"):
        dense_mask(torch.tensor([[1, 2]]), 4, 2)


def captured(fn: object) -> list[object]:
    """Every value a mask_mod's closure holds, through the mask_mods it calls."""
    found: list[object] = []
    for cell in getattr(fn, "__closure__", None) or ():
        value = cell.cell_contents
        found += captured(value) if callable(value) else [value]
    return found


@pytest.mark.parametrize("window", [None, 7, 40])
def test_the_mask_mod_captures_no_number_but_the_block_size(window: int | None) -> None:
    """Dynamo turns a captured number that changes between calls (a context length per bucket,
    a window per layer) into a symbol, which FlexAttention's CuTe-DSL backend refuses ("captures
    a dynamic scalar"); those values reach the kernels as per-row tensors. The block size is
    fixed for a run and stays a number the kernels specialise on."""
    anchors = torch.tensor([[2, 9, 11]])
    mod = draft_mask_mod(
        anchors, torch.ones(1, 3, dtype=torch.bool), 16, 4, window=window, causal_in_block=True
    )
    values = captured(mod)
    numbers = [v for v in values if isinstance(v, int) and not isinstance(v, bool)]
    assert numbers and set(numbers) == {4}
    assert all(isinstance(v, torch.Tensor | bool | int) or v is None for v in values)
