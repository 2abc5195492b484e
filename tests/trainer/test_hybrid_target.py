"""A Qwen3.5-shaped target, tiny and random — linear-attention layers between full-attention
ones, a rope over a quarter of each head, the text model nested in an image-text checkpoint —
through the whole chain: loaded as the causal LM its language model is (the same hidden
states), checked before a run (which names the reference its linear-attention layers run without the
kernels extra, as the run's log does), answering prompts into shards, training a drafter,
exported, and the exported folder evaluated lossless."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.hybrid_target import save_multimodal_hybrid
from trainer.commands import check
from trainer.evaluation import evaluate
from trainer.export.folder import export
from trainer.generation import generate
from trainer.model.target import load_target
from trainer.run.trainer import Trainer
from trainer.settings.loading import load_config


def test_a_hybrid_image_text_checkpoint_goes_from_prompts_to_a_served_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.set_num_threads(1)
    built = save_multimodal_hybrid(str(tmp_path / "target"))
    rope = built.config.text_config.rope_parameters
    assert rope["partial_rotary_factor"] == 0.25
    target = load_target(tmp_path / "target", layers=[0, 1])
    ids = torch.tensor([[5, 9, 2, 77, 31]])
    with torch.no_grad():
        want = built.model.language_model(input_ids=ids, output_hidden_states=True)
    got = target(ids)
    torch.testing.assert_close(got.last_hidden, want.last_hidden_state)
    torch.testing.assert_close(got.features, torch.cat(want.hidden_states[1:3], dim=-1))

    cfg = tmp_path / "train.toml"
    cfg.write_text(
        f'[model]\ntarget = "{tmp_path / "target"}"\nnum_layers = 1\nblock_size = 4\n'
        f'num_target_layers = 2\n[data]\npath = "{tmp_path / "data"}"\nbatch_size = 4\n'
        "max_len = 96\nnum_anchors = 4\nbucket = 16\n"
        '[run]\nsteps = 3\ndevice = "cpu"\nthreads = 1\nlog_every = 1\n'
    )
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(
        json.dumps({"input_ids": [i + 1, 7, 3 * i % 250, 9, i % 13 + 20]}) + "\n" for i in range(12)
    ))  # fmt: skip
    assert generate.main(["--config", str(cfg), "--prompts", str(prompts), "--out",
                          str(tmp_path / "data"), "--max-new-tokens", "10"]) == 0  # fmt: skip
    assert check.main(["--config", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "qwen3_5" in out
    # without the kernels extra, the check and the run's log name the reference that runs
    fallback = (
        "linear attention (Gated DeltaNet) in 2 of 4 target layers: gated delta rule: PyTorch "
        "reference; causal conv1d: PyTorch F.conv1d (the kernels run on CUDA only)"
    )
    assert f"ok: {fallback}" in out.splitlines()
    config = load_config(cfg, [])
    log: list[str] = []
    trainer = Trainer(config, tmp_path / "run", emit=log.append)
    assert fallback in log and not trainer.source.target_compiled()
    assert len(trainer.run()) == 3
    folder = export(config, tmp_path / "run", tmp_path / "drafter", dtype="fp32")
    served = json.loads((folder / "config.json").read_text())
    assert served["head_dim"] == 16 and "partial_rotary_factor" not in json.dumps(served)
    assert evaluate.main(["--config", str(cfg), "--drafter", str(folder), "--prompts",
                          str(prompts), "--limit", "4", "--max-new-tokens", "8", "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["lossless_checked"]  # a mismatch with plain greedy decoding would have failed
