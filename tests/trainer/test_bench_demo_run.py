"""bench/bench_demo_run.py: the demo job under two variants, interleaved, each timed (wall and
CPU seconds of the real `trainer.commands.train` process) and summarised per variant."""

from __future__ import annotations

import json

import pytest

from bench.bench_demo_run import main, parse_variant

SMALL = "demo.num_samples=4 demo.gen_len=8 demo.num_layers=2 data.batch_size=2"


def test_each_variant_is_run_and_timed(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    variants = [f"a: {SMALL}", f"b: {SMALL} demo.num_heads=4 demo.num_kv_heads=2"]
    assert main(["--out", str(out), "--repeat", "1", "--steps", "1",
                 *[x for v in variants for x in ("--variant", v)]]) == 0  # fmt: skip
    got = json.loads(out.read_text())
    assert list(got["variants"]) == ["a", "b"] and got["steps"] == 1
    for name in ("a", "b"):
        (run,) = got["runs"][name]
        assert run["wall_s"] > 0 and run["cpu_s"] > 0
        assert got["variants"][name]["median_wall_s"] == run["wall_s"]
    assert got["variants"]["b"]["settings"][-1] == "demo.num_kv_heads=2"
    assert "| a |" in capsys.readouterr().out


def test_a_variant_needs_a_name() -> None:
    assert parse_variant("x: a=1 b=2") == ("x", ["a=1", "b=2"])
    assert parse_variant("default:") == ("default", [])
    with pytest.raises(Exception, match="NAME: KEY=VALUE"):
        parse_variant(": a=1")
