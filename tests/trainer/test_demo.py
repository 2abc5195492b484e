"""The demo: assets are the target's own greedy output, are reused when complete and rebuilt when
not, and the demo config's first steps match the golden per-step losses.

Regenerate the golden file after an intended numerical change:
    DFLASH_REGEN_GOLDEN=1 python -m pytest -q tests/trainer/test_demo.py -k golden
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from trainer.data.dataset import load_samples
from trainer.model.target import load_target
from trainer.run.trainer import Trainer
from trainer.settings.config import DemoConfig
from trainer.settings.loading import load_config, with_overrides
from trainer.setup.demo import HELDOUT, HELDOUT_PROMPTS, MARKER, ensure_demo_assets

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "assets" / "losses" / "demo.json"
DEMO_TOML = ROOT / "trainer" / "configs" / "demo.toml"
GOLDEN_STEPS = 5


def test_assets_are_the_targets_greedy_output_and_reused(tmp_path) -> None:
    cfg = DemoConfig(enabled=True, num_samples=6, num_layers=2, prompt_len=4, gen_len=10)
    target_dir, data_path = ensure_demo_assets(tmp_path / "a", cfg)
    samples = load_samples(data_path)
    assert len(samples) == 6 and all(len(s.input_ids) == 14 for s in samples)
    assert samples[0].loss_mask == [False] * 4 + [True] * 10
    target = load_target(target_dir)
    ids = torch.tensor([s.input_ids for s in samples])
    with torch.no_grad():
        logits = target.model(input_ids=ids).logits  # (6, 14, V)
    assert torch.equal(logits[:, 3:-1].argmax(-1), ids[:, 4:])  # each generated token is greedy
    stamp = (data_path.stat().st_mtime_ns, (tmp_path / "a" / MARKER).stat().st_mtime_ns)
    ensure_demo_assets(tmp_path / "a", cfg)  # complete: reused
    assert (data_path.stat().st_mtime_ns, (tmp_path / "a" / MARKER).stat().st_mtime_ns) == stamp
    (tmp_path / "a" / MARKER).unlink()  # incomplete: rebuilt, same content (seeded)
    ensure_demo_assets(tmp_path / "a", cfg)
    assert load_samples(data_path) == samples and (tmp_path / "a" / MARKER).is_file()
    other = ensure_demo_assets(
        tmp_path / "a",
        DemoConfig(enabled=True, num_samples=3, num_layers=2, prompt_len=4, gen_len=10),
    )
    assert len(load_samples(other[1])) == 3  # other settings: rebuilt


def test_held_out_prompts_are_the_targets_greedy_output_on_prompts_never_trained_on(
    tmp_path,
) -> None:
    cfg = DemoConfig(enabled=True, num_samples=6, num_layers=2, prompt_len=4, gen_len=10)
    target_dir, data_path = ensure_demo_assets(tmp_path / "a", cfg)
    heldout = tmp_path / "a" / HELDOUT
    held = load_samples(heldout)
    assert len(held) == HELDOUT_PROMPTS and all(
        s.loss_mask == [False] * 4 + [True] * 10 for s in held
    )
    trained = {tuple(s.input_ids[:4]) for s in load_samples(data_path)}
    assert not trained & {tuple(s.input_ids[:4]) for s in held}
    target = load_target(target_dir)
    ids = torch.tensor([s.input_ids for s in held])
    with torch.no_grad():
        logits = target.model(input_ids=ids).logits
    assert torch.equal(logits[:, 3:-1].argmax(-1), ids[:, 4:])
    # assets built before the held-out prompts get them, the rest untouched
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*") if p.is_file()}
    heldout.unlink()
    ensure_demo_assets(tmp_path / "a", cfg)
    assert load_samples(heldout) == held
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "a").rglob("*") if p.is_file()}
    assert {k: v for k, v in after.items() if k != HELDOUT} == {
        k: v for k, v in before.items() if k != HELDOUT
    }


def test_demo_config_first_steps_match_golden(tmp_path) -> None:
    config = load_config(DEMO_TOML)
    config = with_overrides(config, demo={"folder": str(tmp_path / "assets")})
    trainer = Trainer(config, tmp_path / "run", emit=lambda _: None)
    results = trainer.run(until=GOLDEN_STEPS)
    got = {
        "loss": [r.loss for r in results],
        "ce": [r.ce for r in results],
        "kl": [r.kl for r in results],
    }
    if os.environ.get("DFLASH_REGEN_GOLDEN"):
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(
            json.dumps(
                {
                    "config": "trainer/configs/demo.toml",
                    "torch": torch.__version__,
                    "steps": GOLDEN_STEPS,
                    **got,
                },
                indent=1,
            )
            + "\n"
        )
        pytest.skip("golden losses regenerated")
    want = json.loads(GOLDEN.read_text())
    for key in ("loss", "ce", "kl"):
        assert got[key] == pytest.approx(want[key], rel=2e-3, abs=1e-5), key
