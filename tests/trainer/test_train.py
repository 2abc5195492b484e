"""The training loop on a tiny demo target: the loss falls, resume repeats the uninterrupted
losses exactly, the entry point logs, writes metrics.jsonl and refuses a mismatched checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainer.run.features import LocalTarget
from trainer.run.trainer import Trainer
from trainer.settings.config import TrainConfig
from trainer.settings.loading import config_from_dict

TINY = {
    "demo": {"enabled": True, "num_samples": 32, "num_layers": 4, "prompt_len": 6, "gen_len": 26},
    "model": {"num_layers": 1, "block_size": 4, "num_target_layers": 2},
    "data": {"batch_size": 4, "num_anchors": 8, "bucket": 32, "max_len": 64, "noise": 0.01},
    "optim": {"lr": 3e-3, "warmup_steps": 5, "weight_decay": 0.0},
    "run": {"steps": 40, "device": "cpu", "checkpoint_every": 0, "threads": 1},
}


def tiny_config(assets: Path, **sections: dict) -> TrainConfig:
    raw = {k: dict(v) for k, v in TINY.items()}
    raw["demo"]["folder"] = str(assets)
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    return config_from_dict(raw)


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo-assets")


def test_tiny_run_lowers_the_loss(tmp_path, assets) -> None:
    results = Trainer(tiny_config(assets), tmp_path / "run", emit=lambda _: None).run()
    losses = [r.loss for r in results]
    assert len(losses) == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.85 * first, (first, last)
    acc = [sum(r.slot_accuracy) / len(r.slot_accuracy) for r in results]
    assert sum(acc[-5:]) > sum(acc[:5])


def test_resume_equals_uninterrupted(tmp_path, assets) -> None:
    k = 6
    cfg = tiny_config(assets, run={"steps": 2 * k, "checkpoint_every": k})
    full = [r.loss for r in Trainer(cfg, tmp_path / "a", emit=lambda _: None).run()]
    first = Trainer(cfg, tmp_path / "b", emit=lambda _: None)
    part1 = [r.loss for r in first.run(until=k)]
    del first  # the process "stops" after its checkpoint at step k
    lines: list[str] = []
    second = Trainer(cfg, tmp_path / "b", emit=lines.append)
    assert second.step == k and any("resumed from step-00000006" in line for line in lines)
    part2 = [r.loss for r in second.run()]
    assert part1 + part2 == full  # bit-for-bit
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == list(range(1, 2 * k + 1))


def test_resume_in_other_parts_repeats_the_uninterrupted_losses(tmp_path, assets) -> None:
    """`data.micro_batches` changes how a step is computed, not the step: a run stopped at its
    checkpoint resumes in two parts (say, after running out of memory) and goes on as it
    would have in one."""
    k = 4
    cfg = tiny_config(assets, run={"steps": 2 * k, "checkpoint_every": k})
    full = [r.loss for r in Trainer(cfg, tmp_path / "a", emit=lambda _: None).run()]
    first = Trainer(cfg, tmp_path / "b", emit=lambda _: None)
    part1 = [r.loss for r in first.run(until=k)]
    del first
    parts = tiny_config(
        assets, run={"steps": 2 * k, "checkpoint_every": k}, data={"micro_batches": 2}
    )
    second = Trainer(parts, tmp_path / "b", emit=lambda _: None)
    assert second.step == k
    part2 = [r.loss for r in second.run()]
    assert part1 + part2 == pytest.approx(full, rel=1e-5, abs=0)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.run(
        [sys.executable, "-m", "trainer", "train", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def write_toml(path: Path, assets: Path) -> Path:
    lines = []
    for name, values in TINY.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
        if name == "demo":
            lines.append(f"folder = {json.dumps(str(assets))}")
    path.write_text("\n".join(lines) + "\n")
    return path


def test_entry_point_logs_and_writes_metrics(tmp_path, assets) -> None:
    cfg = write_toml(tmp_path / "c.toml", assets)
    out = tmp_path / "run"
    proc = run_cli("--config", str(cfg), "--out", str(out), "--set", "run.steps=3")
    assert proc.returncode == 0, proc.stderr
    assert "step 3/3 | loss" in proc.stdout and "acc%" in proc.stdout and "tok/s" in proc.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("time", "loss", "ce", "kl", "cap", "lr", "tokens_per_s", "slot_accuracy"):
        assert key in rows[0]
    assert len(rows[0]["slot_accuracy"]) == 3
    assert (out / "step-00000003" / "manifest.json").is_file()


def test_entry_point_refuses_mismatch_and_bad_settings(tmp_path, assets) -> None:
    cfg = write_toml(tmp_path / "c.toml", assets)
    out = tmp_path / "run"
    Trainer(tiny_config(assets, run={"steps": 1}), out, emit=lambda _: None).run()
    proc = run_cli(
        "--config",
        str(cfg),
        "--out",
        str(out),
        "--set",
        "run.steps=4",
        "--set",
        "model.block_size=5",
    )
    assert proc.returncode == 2, proc.stderr
    assert "model.block_size" in proc.stderr and "--force-resume" in proc.stderr
    proc = run_cli("--config", str(cfg), "--out", str(out), "--set", "optim.lr=unknown")
    assert proc.returncode == 2 and "optim.lr" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")),
    reason="inductor on the CPU needs a C++ compiler",
)
@pytest.mark.parametrize(
    ("key", "note"),
    [
        ("compile", "compiled: drafter layers (run.compile);"),
        ("compile_target", "compiled: the target's forward (run.compile_target);"),
    ],
)
def test_compiled_parts_train_like_eager_on_the_cpu(tmp_path, assets, key, note) -> None:
    """`run.compile = true` (the drafter's layers) and `run.compile_target = true` (the
    target's forward that makes the run's features), inductor on the CPU here: each says so in
    the log and trains to the same losses as the eager run, step for step, within float32
    reassociation."""
    import torch

    torch._dynamo.reset()
    lines: list[str] = []
    steps = {"steps": 6}
    eager = Trainer(tiny_config(assets, run=steps), tmp_path / "e", emit=lambda _: None).run()
    trainer = Trainer(
        tiny_config(assets, run={**steps, key: True}), tmp_path / "c", emit=lines.append
    )
    assert isinstance(trainer.source, LocalTarget)
    assert trainer.drafter_worker.compiled == (key == "compile")
    assert trainer.source.worker.compiled == (key == "compile_target")
    compiled = trainer.run()
    assert any(note in line for line in lines)
    for a, b in zip(eager, compiled, strict=True):
        assert abs(a.loss - b.loss) <= 1e-4 * abs(a.loss), (a.loss, b.loss)
    torch._dynamo.reset()


def test_the_batch_drawn_ahead_is_not_counted_before_it_is_trained(tmp_path, assets) -> None:
    """The host draws step n+1's batch while step n runs: the epoch note, the metrics' epochs
    and the checkpoint's data position still follow the batches trained."""
    lines: list[str] = []
    cfg = tiny_config(assets, run={"steps": 12, "checkpoint_every": 0})
    trainer = Trainer(cfg, tmp_path / "run", emit=lines.append)
    per_epoch = len(trainer.source.stream.samples) // 4  # batch_size 4, the tail dropped
    assert 2 <= per_epoch < 12
    assert trainer.drafter_worker.drafter.describe() in lines  # the run's shape, on record
    assert lines[-1].startswith("drafter: 1 layer × 64, ")
    trainer.run(until=per_epoch)
    assert trainer.state()["data_position"] == {"epoch": 0, "index": 4 * per_epoch}
    assert not any("begins" in line for line in lines)
    trainer.run(until=per_epoch + 1)
    note = next(i for i, line in enumerate(lines) if "epoch 2 begins" in line)
    steps = [line for line in lines if line.startswith("step ")]
    before = [line for line in lines[:note] if line.startswith("step ")]
    assert before[-1].startswith(f"step {per_epoch}/")
    assert steps[len(before)].startswith(f"step {per_epoch + 1}/")
    # the second run() says where it starts, before the epoch note
    assert lines[note - 1] == f"started training at step {per_epoch} of {per_epoch + 1}"
    assert trainer.state()["data_position"] == {"epoch": 1, "index": 4}
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").open()]
    samples = len(trainer.source.stream.samples)
    assert rows[per_epoch - 1]["epochs"] == 4 * per_epoch / samples
    assert rows[per_epoch]["epochs"] == 1 + 4 / samples
