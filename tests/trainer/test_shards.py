"""Token shards: what is written is read back (memory-mapped, across shard boundaries, truncated
to max_len, sliced), a half-written or truncated shard is never read as data, and the trainer's
batch stream over a shard directory is the stream over the same samples in memory, counting
epochs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from trainer.data.dataset import BatchStream, Sample, load_samples, repeat_note
from trainer.data.shards import (
    Shard,
    ShardError,
    ShardSamples,
    ShardSet,
    finished_shards,
    is_shard_dir,
    remove_temps,
    shard_name,
    write_shard,
)
from trainer.settings.config import DataConfig


def random_samples(n: int, *, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt, answer = rng.randint(1, 12), rng.randint(2, 30)
        ids = [rng.randrange(300_000) for _ in range(prompt + answer)]  # beyond 16 bits
        out.append(Sample(ids, [False] * prompt + [True] * answer))
    return out


def write_set(folder: Path, samples: list[Sample], per_shard: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(0, len(samples), per_shard):
        chunk = samples[k : k + per_shard]
        write_shard(
            folder / shard_name(k // per_shard), [(s.input_ids, s.loss_mask) for s in chunk]
        )


def test_samples_read_back_across_shards_truncated_and_sliced(tmp_path: Path) -> None:
    samples = random_samples(23, seed=1)
    write_set(tmp_path, samples, per_shard=5)
    view = ShardSamples(tmp_path)
    assert len(view) == 23 and len(ShardSet(tmp_path).shards) == 5
    assert [view[i] for i in range(23)] == samples
    short = ShardSamples(tmp_path, max_len=7)
    assert [short[i] for i in range(23)] == [
        Sample(s.input_ids[:7], s.loss_mask[:7]) for s in samples
    ]
    tail = view[18:]
    assert len(tail) == 5 and [tail[i] for i in range(5)] == samples[18:]
    assert list(load_samples(tmp_path)[:3]) == samples[:3]  # the data.path dispatch
    assert is_shard_dir(tmp_path) and not is_shard_dir(tmp_path / shard_name(0))


def test_header_counts_and_empty_shard(tmp_path: Path) -> None:
    write_shard(tmp_path / shard_name(0), [], meta={"prompts": 3, "skipped": ["a.jsonl:2: x"]})
    shard = Shard(tmp_path / shard_name(0))
    assert len(shard) == 0 and shard.header["prompts"] == 3
    assert shard.header["skipped"] == ["a.jsonl:2: x"]


def test_a_half_written_shard_is_never_read(tmp_path: Path) -> None:
    samples = random_samples(6, seed=2)
    write_set(tmp_path, samples, per_shard=3)
    full = (tmp_path / shard_name(1)).read_bytes()
    (tmp_path / f"{shard_name(2)}.tmp-123").write_bytes(full[: len(full) // 2])
    assert list(finished_shards(tmp_path)) == [0, 1]  # the temporary name is not a shard
    assert [p.name for p in remove_temps(tmp_path)] == [f"{shard_name(2)}.tmp-123"]
    (tmp_path / shard_name(1)).write_bytes(full[:-3])  # truncated by something else
    with pytest.raises(ShardError, match="truncated"):
        ShardSet(tmp_path)
    (tmp_path / shard_name(1)).write_bytes(b"garbage" * 10)
    with pytest.raises(ShardError, match="not a dflash shard"):
        Shard(tmp_path / shard_name(1))


def test_batch_stream_over_shards_equals_the_in_memory_stream(tmp_path: Path) -> None:
    samples = random_samples(19, seed=3)
    write_set(tmp_path, samples, per_shard=4)
    cfg = DataConfig(path=str(tmp_path), batch_size=4, max_len=40, num_anchors=4, bucket=16)
    mapped = BatchStream(load_samples(tmp_path, max_len=40), cfg, block_size=4, seed=7)
    memory = BatchStream(
        [Sample(s.input_ids[:40], s.loss_mask[:40]) for s in samples], cfg, block_size=4, seed=7
    )
    for _ in range(6):  # 4 batches per epoch (19 // 4): into the second epoch
        a, b = mapped.next_batch(), memory.next_batch()
        for name in vars(a):
            assert getattr(a, name).equal(getattr(b, name)), name
    assert mapped.position.epoch == 1 and mapped.epochs == pytest.approx(1 + 8 / 19)


def test_repeat_note_names_the_epoch() -> None:
    assert repeat_note(1, 1234).startswith(
        "epoch 2 begins: the drafter now sees repeated samples (1,234 samples per epoch"
    )
    assert repeat_note(2, 1234) == "epoch 3 begins (1,234 samples per epoch)"  # advice once
