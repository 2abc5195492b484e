"""bench/bench_train_loop.py: the whole training loop, timed and profiled (tiny, on the CPU)."""

from __future__ import annotations

import json

from bench.bench_train_loop import main


def test_smoke_run_times_the_loop_and_profiles_after_it(tmp_path, capsys) -> None:
    out, kept = tmp_path / "loop.json", tmp_path / "profile"
    argv = ["--smoke", "--steps", "3", "--warmup", "2", "--profile-steps", "2", "--out", str(out)]
    argv += ["--set", "optim.lr=1e-3", "--keep-profile", str(kept)]
    assert main(argv) == 0
    result = json.loads(out.read_text())
    assert result["overrides"] == ["optim.lr=1e-3"]
    assert {p.suffix for p in kept.iterdir()} >= {".txt", ".json"}
    assert result["timed_steps"] == 3 and result["ms_per_step"] > 0 and result["tokens_per_s"] > 0
    assert (result["profile"]["first"], result["profile"]["last"]) == (6, 7)
    assert result["profile"]["kernel_ms"] > 0 and result["env"]["device"] == "cpu"
    assert "3 steps:" in capsys.readouterr().out


def test_no_profile_unless_asked(tmp_path) -> None:
    out = tmp_path / "loop.json"
    assert main(["--smoke", "--steps", "2", "--warmup", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["profile"] is None
