"""`bench/bench_eval.py --smoke` on the CPU: a tiny target trained on standard-library sources,
two drafter points, each with held-out τ, prompt lookup's τ, training-prompt τ, samples and
epochs; then the same target reused with training data given from outside (`--train-data`)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_helpers import REPO

SCRIPT = REPO / "bench" / "bench_eval.py"
BLOCK = 4  # the smoke drafter's block size


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def check_point(point: dict, *, samples: int, steps: int, batch: int = 4) -> None:
    assert point["samples"] == samples
    assert point["drafter"]["steps"] == steps
    assert point["epochs"] == steps * batch / samples
    for row in (point["held_out"], point["baselines"]["prompt_lookup"], point["train_prompts"]):
        assert 1.0 <= row["tau"] <= BLOCK
        assert row["lossless"] is True and row["lossless_checked"] is True
        assert row["tau"] == pytest.approx(1 + sum(row["slot_acceptance"]))


def test_smoke_points_and_train_data(tmp_path: Path) -> None:
    work, out = tmp_path / "work", tmp_path / "eval.json"
    run = bench("--work", str(work), "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [p["samples"] for p in result["points"]] == [8, 16]
    # every point trains the steps that fit the time budget at the measured step time
    steps = max(1, int(0.3 / result["drafter_step_s"]))
    for point in result["points"]:
        check_point(point, samples=point["samples"], steps=steps)
    # the largest point's fields at the top level
    assert result["samples"] == 16 and result["epochs"] == steps * 4 / 16
    assert result["held_out"] == result["points"][-1]["held_out"]
    assert result["train_prompts"] == result["points"][-1]["train_prompts"]
    lookup = result["baselines"]["prompt_lookup"]
    assert lookup["max_n"] == 4 and lookup["prompts"] == result["held_out"]["prompts"] == 2
    assert "prompt lookup (n 4…1):" in run.stdout

    data = tmp_path / "data.jsonl"  # data made elsewhere with the same target
    shutil.copy(work / "train-8.jsonl", data)
    again = bench(
        "--work", str(work), "--out", str(out), "--reuse-target", "--train-data", str(data),
        "--drafter-steps", "4",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    reused = json.loads(out.read_text())
    assert reused["training_data"] == str(data) and reused["target"] == {
        "reused": str(work / "target")
    }
    assert [p["samples"] for p in reused["points"]] == [8]  # no more than there are
    check_point(reused["points"][0], samples=8, steps=4)
    assert reused["baselines"]["prompt_lookup"]["tau"] == lookup["tau"]  # same target, prompts

    refused = bench("--work", str(work), "--train-data", str(data))
    assert refused.returncode == 2 and "--train-data needs --reuse-target" in refused.stderr
