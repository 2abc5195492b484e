"""Evaluation against trained drafters: τ follows real learning and exposes an off-by-one that
training accuracy hides; the training loop logs τ; the entry point reads checkpoints.

The trained-drafter tests evaluate on the prompts of the training samples: the data are the
target's own greedy continuations, so greedy decoding of those prompts revisits exactly the
contexts the drafter was trained on, and the two runs differ only in the label alignment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import trainer.data.dataset as data_module
from trainer.data.dataset import load_samples
from trainer.data.eval_prompts import prompt_of_sample
from trainer.evaluation.drafters import DFlashDrafter
from trainer.evaluation.report import EvalReport, evaluate
from trainer.evaluation.speculative import greedy_decode
from trainer.model.target import Target
from trainer.run.trainer import Trainer
from trainer.settings.config import TrainConfigError
from trainer.settings.loading import config_from_dict

BLOCK = 4
BASE = {
    # a 2-layer target: few repeated tokens in its output (a shifted label is rarely right by luck)
    "demo": {"enabled": True, "num_samples": 8, "num_layers": 2, "prompt_len": 6, "gen_len": 26},
    "model": {"num_layers": 1, "block_size": BLOCK, "num_target_layers": 2},
    "data": {"batch_size": 8, "num_anchors": 32, "bucket": 32, "max_len": 64, "noise": 0.0},
    "optim": {"lr": 1e-2, "warmup_steps": 10, "weight_decay": 0.0},
    "run": {"steps": 200, "device": "cpu", "checkpoint_every": 0, "threads": 1, "log_every": 50},
}


def make_config(assets: Path, **sections: dict) -> dict:
    raw = {k: dict(v) for k, v in BASE.items()}
    raw["demo"]["folder"] = str(assets)
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return raw


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo-assets")


@dataclass
class Trained:
    accuracy: list[float]  # training accuracy per slot over the last 10 steps
    report: EvalReport  # on the training prompts
    block: DFlashDrafter
    target: Target
    prompts: list[list[int]]

    @property
    def tau(self) -> float:
        return self.report.tau


def train_and_evaluate(assets: Path, out: Path) -> Trained:
    """Train on the demo data, then evaluate on the training prompts."""
    trainer = Trainer(config_from_dict(make_config(assets)), out, emit=lambda _: None)
    results = trainer.run()
    tail = [r.slot_accuracy for r in results[-10:]]
    accuracy = [sum(col) / len(col) for col in zip(*tail, strict=True)]
    target = trainer.source.target
    prompts = [prompt_of_sample(s) for s in load_samples(trainer.config.data.path)]
    block = DFlashDrafter(
        trainer.drafter_worker.drafter,
        embed_weight=target.embed_weight,
        lm_head_weight=target.lm_head_weight,
    )
    report = evaluate(target, block, prompts, max_new_tokens=BASE["demo"]["gen_len"])
    assert report.lossless_checked
    return Trained(accuracy, report, block, target, prompts)


@pytest.fixture(scope="module")
def trained(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    return train_and_evaluate(assets, tmp_path_factory.mktemp("run"))


@pytest.mark.slow
def test_trained_drafter_raises_tau(trained) -> None:
    assert trained.tau > 1.5, (trained.tau, trained.accuracy)


@pytest.mark.slow
def test_accuracy_at_every_position_is_the_training_measure(trained) -> None:
    """On the contexts it trained on, the drafter's accuracy by slot at every output position
    is its training accuracy; and it is what separate `draft` calls, one per anchor, give."""
    every = trained.report.slot_accuracy
    assert every is not None and len(every) == BLOCK - 1
    assert every[0] > 0.5, every
    for got, want in zip(every, trained.accuracy, strict=True):
        assert abs(got - want) < 0.15, (every, trained.accuracy)
    right = [0] * (BLOCK - 1)
    blocks = 0
    for prompt in trained.prompts:
        seq = [*prompt, *greedy_decode(trained.target, prompt, BASE["demo"]["gen_len"])]
        ids = torch.tensor([seq])
        features = trained.target(ids).features
        for a in range(len(prompt), len(seq) - BLOCK + 1):
            draft = trained.block.draft(features[:, :a], ids[:, : a + 1], a).tolist()
            right = [r + (d == t) for r, d, t in zip(right, draft, seq[a + 1 :], strict=False)]
            blocks += 1
    assert every == pytest.approx([r / blocks for r in right], abs=1e-12)


@pytest.mark.slow
def test_off_by_one_labels_train_well_but_tau_stays_near_one(
    tmp_path, assets, trained, monkeypatch
) -> None:
    """Labels shifted one slot back (slot k learns x_{p+k−1}, slot 1 the anchor token it can
    see): the public trainers' bug. Training accuracy looks excellent; decoding exposes it."""
    right = data_module.block_labels

    def shifted(input_ids, loss_mask, anchors, valid, block_size):
        return right(input_ids, loss_mask, (anchors - 1).clamp(min=0), valid, block_size)

    monkeypatch.setattr(data_module, "block_labels", shifted)
    shifted_run = train_and_evaluate(assets, tmp_path / "run")
    accuracy, tau = shifted_run.accuracy, shifted_run.tau
    assert accuracy[0] > 0.9, accuracy  # slot 1 copies the anchor token it can see
    assert sum(accuracy) >= 0.9 * sum(trained.accuracy), (accuracy, trained.accuracy)
    assert tau < 1.3 and trained.tau - tau > 0.3, (tau, trained.tau)
    # measured at every position of the target's output, the accuracy says so too
    every = shifted_run.report.slot_accuracy
    assert every is not None and every[0] < 0.3, every


def test_training_logs_tau_on_held_out_samples(tmp_path, assets) -> None:
    raw = make_config(
        assets,
        data={"holdout": 2, "batch_size": 4},
        run={"steps": 4, "log_every": 3},
        eval={"every": 2, "num_prompts": 2, "max_new_tokens": 8},
    )
    lines: list[str] = []
    trainer = Trainer(config_from_dict(raw), tmp_path / "run", emit=lines.append)
    assert len(trainer.source.stream.samples) == 6  # 8 samples, the last 2 held out
    assert trainer.source.tau_probe is not None and len(trainer.source.tau_probe.prompts) == 2
    trainer.run()
    steps = [line for line in lines if line.startswith("step ")]
    assert [s.split("/")[0] for s in steps] == ["step 2", "step 3", "step 4"]
    assert "| tau " in steps[0] and "| tau " not in steps[1] and "| tau " in steps[2]
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 3, 4]
    assert 1.0 <= rows[0]["tau"] <= BLOCK and "tau" not in rows[1]
    assert len(rows[2]["slot_acceptance"]) == len(rows[2]["held_out_slot_accuracy"]) == BLOCK - 1


def test_eval_settings_are_checked(assets) -> None:
    with pytest.raises(TrainConfigError, match="eval.prompts"):
        config_from_dict(make_config(assets, eval={"every": 5}))
    with pytest.raises(TrainConfigError, match="eval.every"):
        config_from_dict(make_config(assets, eval={"every": -1}))
    with pytest.raises(TrainConfigError, match="data.holdout"):
        Trainer(
            config_from_dict(make_config(assets, data={"holdout": 8})),
            assets.parent / "never",
            emit=lambda _: None,
        )


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(
        [sys.executable, "-m", "trainer", "evaluate", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
    )


def test_entry_point_reads_a_checkpoint(tmp_path, assets) -> None:
    raw = make_config(assets, run={"steps": 2})
    Trainer(config_from_dict(raw), tmp_path / "run", emit=lambda _: None).run()
    cfg = tmp_path / "c.toml"
    lines = []
    for name, values in raw.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    cfg.write_text("\n".join(lines) + "\n")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"input_ids": [3, 1, 4, 1, 5], "loss_mask": [0] * 5}) + "\n")
    common = ["--config", str(cfg), "--prompts", str(prompts), "--max-new-tokens", "6"]
    proc = run_cli(*common, "--checkpoint", str(tmp_path / "run"), "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["prompts"] == 1 and report["new_tokens"] == 6 and report["lossless_checked"]
    assert 1.0 <= report["tau"] <= BLOCK
    lookup = report["baselines"]["prompt_lookup"]  # beside the drafter, on the same prompt
    assert 1.0 <= lookup["tau"] <= BLOCK and lookup["new_tokens"] == 6
    step = tmp_path / "run" / "step-00000002"
    proc = run_cli(*common, "--checkpoint", str(step), "--set", "model.block_size=5")
    assert proc.returncode == 2 and "model.block_size" in proc.stderr
