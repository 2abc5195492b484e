"""The τ probe of a 1 + 1 split on two GPUs: drafter rank 0 broadcasts the drafter's weights to
target rank 0 over their own NCCL group while features flow on the default group; the probed
rows carry held-out, training-prompt and prompt-lookup τ, and training goes on after each probe."""

from __future__ import annotations

import json

import pytest

from tests.trainer.test_split import assets as split_assets  # noqa: F401 (a fixture)
from tests.trainer.test_split import run_split

pytestmark = pytest.mark.gpu2


def test_split_probe_on_two_gpus(tmp_path, split_assets) -> None:  # noqa: F811
    evaluation = {"every": 3, "num_prompts": 3, "train_prompts": 2, "max_new_tokens": 8}
    out, log, ranks = run_split(
        tmp_path,
        split_assets,
        procs=2,
        targets=1,
        data={"holdout": 8, "batch_size": 12},
        evaluation=evaluation,
        steps=6,
        checkpoint_every=4,
        device="cuda",
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    probed = [r for r in rows if "tau" in r]
    assert [r["probe"]["step"] for r in probed] == [3, 6]
    for r in probed:
        for key in ("tau", "tau_train", "tau_prompt_lookup"):
            assert 1.0 <= r["probe"][key] <= 4.0, r["probe"]
    assert ranks[1]["batches"] == 6 and "| tau " in log
