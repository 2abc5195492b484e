"""The generation benchmark's smoke mode: both engines decode the same prompts on the CPU, the
answers agree token for token, and the JSON carries the throughput of each and their ratio."""

from __future__ import annotations

import json
from pathlib import Path

from bench.bench_generate import decode_rate, main


def test_smoke_run_compares_with_plain_generate(tmp_path: Path) -> None:
    out = tmp_path / "results" / "generate.json"
    assert main(["--smoke", "--out", f"{tmp_path / 'results'}/"]) == 0
    result = json.loads(out.read_text())
    engines = {row["engine"]: row for row in result["rows"]}
    assert set(engines) == {"transformers generate", "trainer.generation.decode"}
    assert all(row["answer_tokens"] > 0 and row["tokens_per_s"] > 0 for row in engines.values())
    assert (
        engines["transformers generate"]["answer_tokens"]
        == engines["trainer.generation.decode"]["answer_tokens"]
    )
    assert result["summary"]["identical_answers"] == 1.0
    assert result["summary"]["ended_early"] >= 1
    assert result["summary"]["speedup_vs_generate"] > 0
    (row,) = result[
        "pipeline"
    ]  # the whole trainer.generation.generate in one process: the same answers
    assert row["processes"] == 1 and row["answer_tokens"] == result["summary"]["answer_tokens_kept"]
    (rank_s,) = row["rank_decode_s"]  # read from the rank's own log line
    assert rank_s > 0 and row["tokens_per_s_decode"] > 0


def test_ranks_decode_together_as_fast_as_the_slowest() -> None:
    """Two ranks of 600 tokens at 300 and 200 tok/s: 1,200 tokens in 3 s, not 500 tok/s."""
    assert decode_rate([(600, 300.0), (600, 200.0)]) == 400.0
    assert decode_rate([(900, 300.0)]) == 300.0
    assert decode_rate([]) is None and decode_rate([(10, 0.0)]) is None
