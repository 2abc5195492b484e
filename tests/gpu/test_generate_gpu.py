"""On a GPU: batched KV-cached decoding of a float32 target equals plain greedy decoding with
both engines (the static one replaying its step as a CUDA graph per mask width, through the
grouped step attention, rows ending early included; a hybrid linear-attention target with the
dynamic engine), and `trainer.generation.generate` writes complete shards on CUDA (bf16)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.trainer.hybrid_target import hybrid_model
from trainer.data.shards import MANIFEST, ShardSamples
from trainer.generation.decode import decode_batch
from trainer.generation.generate import main
from trainer.settings.config import DemoConfig
from trainer.setup.demo import ensure_demo_assets

pytestmark = pytest.mark.gpu
DEMO = DemoConfig(enabled=True, num_samples=8, num_layers=2, prompt_len=6, gen_len=8)


def greedy(model: torch.nn.Module, prompt: list[int], n: int, eos: set[int]) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([seq], device="cuda")).logits[0, -1]
        seq.append(int(logits.argmax()))
        if seq[-1] in eos:
            break
    return seq[len(prompt) :]


@pytest.mark.parametrize("engine", ["dynamic", "static"])
def test_cuda_decoding_equals_plain_greedy(tmp_path: Path, engine: str) -> None:
    from transformers import AutoModelForCausalLM

    target, _ = ensure_demo_assets(tmp_path / "assets", DEMO)
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).cuda().eval()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (int(n),), generator=gen).tolist() for n in (3, 9, 5, 12)]
    free = [greedy(model, p, 80, set()) for p in prompts]
    eos = {free[1][70]}  # row 1 (at least) ends by step 70, in the second mask width
    got = decode_batch(model, prompts, max_new_tokens=80, eos_ids=eos, pad_id=256, engine=engine)
    assert got == [greedy(model, p, 80, eos) for p in prompts]


def test_a_hybrid_target_decodes_on_cuda_as_plain_greedy(monkeypatch: pytest.MonkeyPatch) -> None:
    """`auto` takes the dynamic engine (the static one refuses linear-attention layers): the
    recurrent states follow left padding and rows leaving the batch. cuDNN's TF32 convolutions
    off, so that the float32 comparison is exact."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    model = hybrid_model().cuda()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (int(n),), generator=gen).tolist() for n in (3, 9, 5, 12)]
    free = [greedy(model, p, 16, set()) for p in prompts]
    eos = {free[1][5]}
    got = decode_batch(model, prompts, max_new_tokens=16, eos_ids=eos, pad_id=0, engine="auto")
    assert got == [greedy(model, p, 16, eos) for p in prompts]


def test_generate_on_cuda_writes_shards(tmp_path: Path) -> None:
    target, _ = ensure_demo_assets(tmp_path / "assets", DEMO)
    cfg = tmp_path / "train.toml"
    cfg.write_text(f'[model]\ntarget = "{target}"\n[data]\npath = "x"\nmax_len = 64\n')
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"text": f"prompt {i}"}) + "\n" for i in range(20)))
    out = tmp_path / "out"
    assert main(["--config", str(cfg), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "16", "--shard-size", "8"]) == 0  # fmt: skip
    assert json.loads((out / MANIFEST).read_text())["counts"]["samples"] == 20
    assert len(ShardSamples(out)) == 20
