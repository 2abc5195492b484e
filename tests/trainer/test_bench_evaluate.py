"""`bench/bench_evaluate.py --smoke`: both drafters timed one prompt at a time and in batches,
with the same per-prompt counts both ways."""

from __future__ import annotations

import json
from pathlib import Path

from bench.bench_evaluate import main


def test_smoke_run_times_both_ways(tmp_path: Path, capsys) -> None:
    out = tmp_path / "evaluate.json"
    assert main(["--smoke", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["drafter"] for r in result["rows"]] == ["dflash (random, 4 layers)", "prompt lookup"]
    for row in result["rows"]:
        assert row["one at a time, s"] > 0 and row["batched, s"] > 0
        assert row["same counts"] is True and row["tau batched"] == row["tau one at a time"]
    assert "| drafter | one at a time, s | batched, s |" in capsys.readouterr().out
