"""bench/profile_drafter.py: a real (tiny, CPU) profiled run."""

from __future__ import annotations

import json

import pytest

from bench.profile_drafter import main


def test_smoke_run_writes_its_summary(tmp_path, capsys) -> None:
    out = tmp_path / "profile.json"
    argv = ["--smoke", "--steps", "1", "--warmup", "1", "--attention-kernels", "small"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["step_ms"] > 0
    assert result["attention_kernels"] == "small"
    assert result["compiled_layers"] is False and result["model_flops_per_step"] > 0
    kinds = {r["kind"] for r in result["kinds"]}
    assert {"matmul", "attention forward", "optimizer"} <= kinds
    assert sum(r["share"] for r in result["kinds"]) == pytest.approx(1.0)
    assert "| kind | ms per step | share of kernel time |" in capsys.readouterr().out


def test_smoke_run_in_parts_counts_the_whole_batch(tmp_path) -> None:
    """Two sequences a step in two parts: the model FLOPs and tokens of both sequences."""
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    base = ["--smoke", "--steps", "1", "--warmup", "1"]
    assert main([*base, "--out", str(one)]) == 0
    assert main([*base, "--batch-size", "2", "--micro-batches", "2", "--out", str(two)]) == 0
    single, double = (json.loads(p.read_text()) for p in (one, two))
    assert (double["batch_size"], double["micro_batches"]) == (2, 2)
    assert double["model_flops_per_step"] == pytest.approx(
        2 * single["model_flops_per_step"], rel=0.25
    )  # the same shapes, other random tokens
    assert double["tokens_per_s"] == pytest.approx(2 * 128 / (double["step_ms"] / 1e3))
