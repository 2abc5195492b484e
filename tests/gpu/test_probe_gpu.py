"""The evaluation side on CUDA: prompt lookup decodes losslessly through `evaluate` with the
target's tensors on the GPU (fp32, so that argmax ties between forward lengths cannot break the
check), and a training run on CUDA (bf16 target, drafter layers eager) probes held-out and
training-prompt τ beside prompt lookup and draws them in TensorBoard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu

DEMO = {"enabled": True, "num_samples": 8, "num_layers": 2, "prompt_len": 6, "gen_len": 26}


def test_prompt_lookup_is_lossless_on_cuda(tmp_path: Path) -> None:
    from trainer.evaluation.prompt_lookup import PromptLookupDrafter
    from trainer.evaluation.report import evaluate
    from trainer.model.target import load_target
    from trainer.settings.config import DemoConfig
    from trainer.setup.demo import ensure_demo_assets

    target_dir, _ = ensure_demo_assets(tmp_path, DemoConfig(**DEMO))
    target = load_target(target_dir, device="cuda", num_layers=2)
    target.model.float()
    gen = torch.Generator().manual_seed(0)
    prompts = [
        [t % 8 for t in row] for row in torch.randint(0, 256, (4, 8), generator=gen).tolist()
    ]
    report = evaluate(target, PromptLookupDrafter(8), prompts, max_new_tokens=40, eos=[])
    assert report.lossless_checked and report.tau >= 1.0
    assert report.tau == pytest.approx(1 + sum(report.slot_acceptance))


def test_training_on_cuda_probes_both_taus_beside_prompt_lookup(tmp_path: Path) -> None:
    from trainer.run.curves import available
    from trainer.run.trainer import Trainer
    from trainer.settings.loading import config_from_dict

    raw = {
        "demo": {**DEMO, "folder": str(tmp_path / "assets")},
        "model": {"num_layers": 1, "block_size": 4, "num_target_layers": 2},
        "data": {"batch_size": 4, "num_anchors": 32, "bucket": 128, "max_len": 64, "holdout": 4},
        "optim": {"lr": 1e-2, "warmup_steps": 5},
        "run": {"steps": 20, "device": "cuda", "compile": False, "checkpoint_every": 0},
        "eval": {"every": 10, "num_prompts": 4, "train_prompts": 4, "max_new_tokens": 16},
    }
    lines: list[str] = []
    out = tmp_path / "run"
    Trainer(config_from_dict(raw), out, emit=lines.append).run()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    probed = [r["probe"] for r in rows if "tau" in r]
    assert [p["step"] for p in probed] == [10, 20]
    for probe in probed:
        for key in ("tau", "tau_train", "tau_prompt_lookup"):
            assert 1.0 <= probe[key] <= 4.0, probe
    probe_line = re.compile(
        r"\| tau \d\.\d\d \((95% \d\.\d\d–\d\.\d\d; )?train \d\.\d\d, lookup \d\.\d\d\)"
    )
    assert any(probe_line.search(line) for line in lines), lines
    if available():
        assert any((out / "tensorboard").iterdir())
