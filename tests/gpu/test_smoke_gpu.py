"""`python -m trainer smoke` on CUDA: compiled FlexAttention + the chunked loss in bf16 agree
with float64 within the smoke test's bounds (run with `pytest tests/gpu`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainer.commands import smoke

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
REPO = Path(__file__).resolve().parents[2]


def test_cuda_smoke_passes_on_the_compiled_flex_path():
    report = smoke.run()
    assert report["ok"], report.get("error") or report
    assert report["cuda"] and report["backend"] == "flex"
    assert report["peak_mib"] is not None and report["peak_mib"] > 0
    bounds = smoke.TOLERANCE["cuda"]
    assert report["rel_errors"]["loss"] <= bounds["loss"]
    assert all(report["rel_errors"][f"grad_{n}"] <= bounds["grad"] for n in "qkv")


def test_module_entry_point_prints_one_json_object():
    result = subprocess.run(
        [sys.executable, "-m", "trainer", "smoke", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["ok"] and report["cuda"]
