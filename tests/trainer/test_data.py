"""Data: anchor/label alignment (the off-by-one), bucketing, determinism, prepare with a chat
template."""

from __future__ import annotations

import json

import pytest
import torch

from trainer.data.dataset import (
    IGNORE,
    BatchStream,
    DataPosition,
    Sample,
    anchor_candidates,
    block_labels,
    bucket_length,
    collate,
    draw_anchors,
    load_samples,
    prepare,
    write_samples,
)
from trainer.settings.config import DataConfig
from trainer.setup.demo import build_tokenizer


def test_anchor_candidates_need_next_supervised() -> None:
    mask = [False, False, True, True, True, False, True, True, False, True]
    assert anchor_candidates(mask).tolist() == [2, 3, 6]


def test_labels_slot_k_predicts_token_at_anchor_plus_k() -> None:
    ids = torch.tensor([[100 + i for i in range(10)]])  # token at position i is 100 + i
    mask = torch.tensor([[False, False, True, True, True, True, False, True, True, True]])
    anchors = torch.tensor([[2, 7, 0]])
    valid = torch.tensor([[True, True, False]])
    labels = block_labels(ids, mask, anchors, valid, block_size=4)
    assert labels.tolist() == [
        [
            [IGNORE, 103, 104, 105],  # block at 2: slot k → x_{2+k}; all supervised
            [IGNORE, 108, 109, IGNORE],  # block at 7: position 10 is past the end
            [IGNORE] * 4,  # invalid block
        ]
    ]
    # a supervision hole inside a block is ignored, the rest kept
    labels = block_labels(ids, mask, torch.tensor([[4]]), torch.tensor([[True]]), block_size=4)
    assert labels.tolist() == [[[IGNORE, 105, IGNORE, 107]]]


def test_collate_equals_labels_and_anchors_written_out_per_sample() -> None:
    """Random lengths, supervision holes and padding: every batch field equals the definition
    applied to each sample on its own (anchors among p with p and p+1 supervised, drawn by the
    sample's generator; slot k ≥ 1 labels x_{p+k} where it exists and is supervised)."""
    rng = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(6):
        n = int(torch.randint(3, 90, (1,), generator=rng))  # the batch is padded to 96
        ids = torch.randint(0, 500, (n,), generator=rng).tolist()
        mask = (torch.rand(n, generator=rng) < 0.8).tolist()
        samples.append(Sample(ids, mask))
    samples.append(Sample(list(range(96)), [True] * 96))  # fills its bucket: blocks run off the end
    block, anchors_n = 5, 12
    batch = collate(
        samples,
        block_size=block,
        num_anchors=anchors_n,
        bucket=32,
        pad_token_id=7,
        generators=[torch.Generator().manual_seed(40 + i) for i in range(len(samples))],
    )
    for i, s in enumerate(samples):
        cand = anchor_candidates(s.loss_mask).tolist()
        gen = torch.Generator().manual_seed(40 + i)
        if len(cand) > anchors_n:
            pick = torch.randperm(len(cand), generator=gen)[:anchors_n].tolist()
            cand = sorted(cand[j] for j in pick)
        assert batch.valid[i].tolist() == [j < len(cand) for j in range(anchors_n)]
        assert batch.anchors[i].tolist() == cand + [0] * (anchors_n - len(cand))
        for n_, p in enumerate(cand):
            want = [
                s.input_ids[p + k]
                if k >= 1 and p + k < len(s.input_ids) and s.loss_mask[p + k]
                else IGNORE
                for k in range(block)
            ]
            assert batch.labels[i, n_].tolist() == want
        assert (batch.labels[i, len(cand) :] == IGNORE).all()
        assert batch.input_ids[i, : len(s.input_ids)].tolist() == s.input_ids
        assert (batch.input_ids[i, len(s.input_ids) :] == 7).all()


def test_draw_anchors_sorted_padded_and_capped() -> None:
    supervised = torch.zeros(3, 50, dtype=torch.bool)
    supervised[0] = True  # 49 candidates: 8 drawn
    supervised[1, 1:4] = True  # candidates 1 and 2 only
    # row 2: no two consecutive supervised tokens, no candidate
    supervised[2, ::2] = True
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    anchors, valid = draw_anchors(supervised, 8, gens)
    assert anchors.shape == valid.shape == (3, 8)
    assert valid[0].all() and anchors[0].tolist() == sorted(anchors[0].tolist())
    assert len(set(anchors[0].tolist())) == 8 and anchors[0].max() < 49
    want = torch.randperm(49, generator=torch.Generator().manual_seed(0))[:8].sort().values
    assert anchors[0].tolist() == want.tolist()  # the row's own generator decides
    assert anchors[1].tolist() == [1, 2] + [0] * 6
    assert valid[1].tolist() == [True, True] + [False] * 6
    assert not valid[2].any() and not anchors[2].any()


def test_bucketing_pads_to_multiples() -> None:
    assert bucket_length(1, 128) == 128
    assert bucket_length(128, 128) == 128
    assert bucket_length(129, 128) == 256
    samples = [Sample([1] * 70, [True] * 70), Sample([2] * 130, [True] * 130)]
    gens = [torch.Generator().manual_seed(i) for i in range(2)]
    batch = collate(
        samples, block_size=4, num_anchors=16, bucket=64, pad_token_id=9, generators=gens
    )
    assert batch.input_ids.shape == (2, 192)
    assert batch.input_ids[0, 70:].eq(9).all() and batch.lengths.tolist() == [70, 130]
    assert batch.labels.shape == (2, 16, 4)


def test_stream_is_deterministic_and_resumable() -> None:
    gen = torch.Generator().manual_seed(1)
    samples = [
        Sample(torch.randint(0, 50, (n,), generator=gen).tolist(), [False] * 3 + [True] * (n - 3))
        for n in range(10, 30)
    ]
    cfg = DataConfig(path="x", batch_size=3, num_anchors=4, bucket=8)
    a = BatchStream(samples, cfg, block_size=4, seed=5)
    first = [a.next_batch() for _ in range(9)]  # crosses an epoch boundary (20 // 3 = 6 per epoch)
    b = BatchStream(samples, cfg, block_size=4, seed=5)
    for _ in range(4):
        b.next_batch()
    resumed = BatchStream(samples, cfg, block_size=4, seed=5, position=b.position)
    for want in first[4:]:
        got = resumed.next_batch()
        assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.labels, want.labels)
    assert a.position.epoch == 1
    other = BatchStream(samples, cfg, block_size=4, seed=6).next_batch()
    assert not torch.equal(other.input_ids, first[0].input_ids)
    assert isinstance(a.position, DataPosition)


def test_jsonl_roundtrip_and_errors(tmp_path) -> None:
    path = tmp_path / "d.jsonl"
    write_samples(path, [Sample([1, 2, 3], [False, True, True])])
    assert load_samples(path) == [Sample([1, 2, 3], [False, True, True])]
    assert load_samples(path, max_len=2) == [Sample([1, 2], [False, True])]
    path.write_text(json.dumps({"input_ids": [1, 2]}) + "\n")
    with pytest.raises(ValueError, match="loss_mask"):
        load_samples(path)


def test_prepare_supervises_assistant_turns_only(tmp_path) -> None:
    build_tokenizer(tmp_path / "tok")
    chat = tmp_path / "chat.jsonl"
    convo = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "bye"},
            {"role": "assistant", "content": "ok"},
        ]
    }
    chat.write_text(json.dumps(convo) + "\n")
    out = tmp_path / "tok.jsonl"
    assert prepare(chat, tmp_path / "tok", out) == 1
    (sample,) = load_samples(out)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"), local_files_only=True)
    supervised = [t for t, m in zip(sample.input_ids, sample.loss_mask, strict=True) if m]
    end = "<|im_end|>\n"
    assert tok.decode(supervised) == "hello" + end + "ok" + end
    assert (
        sample.input_ids == tok.apply_chat_template(convo["messages"], tokenize=True)["input_ids"]
    )
