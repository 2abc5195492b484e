"""1 target + 1 drafter on two GPUs: a Qwen3-8B-shaped target (random bf16 weights built on
the GPU from an in-memory `transformers` config: 36 layers, hidden 4096, 32 heads, 8 kv heads,
head dim 128, MLP 12288, vocabulary 151,936), a 5-layer drafter, sequences of 4,096 tokens with
512 anchors, a few steps through the real split run (two spawned processes, NCCL p2p, DDP over
the drafter group): losses finite, every batch produced once and trained once, per-rank GPU
memory reported, the drafter's rank holds no target."""

from __future__ import annotations

import json
import math

import pytest

pytestmark = pytest.mark.gpu2


def test_one_target_one_drafter_qwen3_8b_shape(tmp_path) -> None:
    from bench.bench_pipeline import FULL, run_split_procs, write_data

    spec = {**FULL, "samples": 8, "split_steps": 3}
    data = tmp_path / "data.jsonl"
    write_data(data, spec)
    rows = run_split_procs(spec, data, tmp_path / "run", device="cuda")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) and r["loss"] > 0
        assert r["tokens"] == 4096
    last = rows[-1]
    assert last["batches"] == {"produced": 3, "trained": 3}
    target, drafter = last["ranks"]
    assert (target["role"], target["gpu"]) == ("target", 0)
    assert (drafter["role"], drafter["gpu"]) == ("drafter", 1)
    assert target["mem_gib"] > 14  # the 8B target in bf16 lives on GPU 0
    assert drafter["mem_gib"] < 40  # drafter, AdamW, embedding and lm_head only: no target
    ranks = [
        json.loads((tmp_path / "run" / "ranks" / f"rank-{r}.json").read_text()) for r in (0, 1)
    ]
    assert sorted(ranks[0]["indices"]) == sorted(ranks[1]["indices"]) == [0, 1, 2]
