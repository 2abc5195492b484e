"""A graceful stop of a 1 + 1 split on two GPUs (NCCL p2p and the drafters' all-reduce): SIGINT
to the launcher, the run saves the agreed step and exits 0, the restart trains every remaining
batch exactly once and the metrics continue step by step."""

from __future__ import annotations

import json

import pytest

from tests.trainer.test_split import assets as split_assets  # noqa: F401 (a fixture)
from tests.trainer.test_stop import rows, split_stop_and_resume

pytestmark = pytest.mark.gpu2


def test_split_stop_on_two_gpus(tmp_path, split_assets) -> None:  # noqa: F811
    steps = 10
    out, n, ranks = split_stop_and_resume(
        tmp_path, split_assets, procs=2, targets=1, steps=steps, device="cuda"
    )
    trained = [i for r in ranks if r["role"] == "drafter" for i in r["indices"]]
    assert trained == list(range(steps))
    assert [r["step"] for r in rows(out)] == list(range(1, steps + 1))
    manifest = json.loads((out / f"step-{steps:08d}" / "manifest.json").read_text())
    assert manifest["resolved"]["run.device"].startswith("cuda")
