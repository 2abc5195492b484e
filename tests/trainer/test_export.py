"""Export: a trained demo drafter written as the engines' Hugging Face folder and read back
(equal block logits and τ), its config and tensor names against what the engines' loaders read,
and every refusal."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from trainer.data.dataset import load_samples
from trainer.data.eval_prompts import prompt_of_sample
from trainer.evaluation.drafters import DFlashDrafter
from trainer.evaluation.engine_report import EngineRequest, write_report
from trainer.evaluation.report import evaluate
from trainer.evaluation.speculative import speculative_decode_many
from trainer.export.folder import ExportRefused, export
from trainer.export.hf_format import DrafterFolderError, hf_tensors, load_folder, write_folder
from trainer.model import checkpoint as ckpt
from trainer.model.drafter import DRAFTER_FORMAT
from trainer.model.target import default_target_layers
from trainer.run.trainer import Trainer
from trainer.settings.loading import config_from_dict

ROOT = Path(__file__).resolve().parents[2]
RAW = {
    "demo": {"enabled": True, "num_samples": 8, "num_layers": 4, "prompt_len": 6, "gen_len": 26},
    "model": {
        "num_layers": 2,
        "block_size": 4,
        "num_target_layers": 2,
        "sliding_window": 6,
        "sliding_layers": [0],
    },
    "data": {"batch_size": 8, "num_anchors": 16, "bucket": 32, "max_len": 64},
    "optim": {"lr": 1e-2, "warmup_steps": 5, "weight_decay": 0.0},
    "run": {"steps": 30, "device": "cpu", "checkpoint_every": 0, "threads": 1, "log_every": 30},
}

# What the engines read, as data (see docs/serving.md for the versions):
# - the DFlash authors' DFlashDraftModel (github.com/z-lab/dflash 44947fb, dflash/model.py):
#   Qwen3 modules named below, `dflash_config.target_layer_ids`/`mask_token_id`, `block_size`,
#   `num_target_layers`, `layer_types`, `sliding_window`;
# - SGLang (python/sglang/srt/models/dflash.py at 003b23d): q/k/v_proj stacked into qkv_proj,
#   gate/up_proj into gate_up_proj, `q_norm`/`k_norm` always, unknown names skipped;
# - vLLM (vllm/model_executor/models/qwen3_dflash.py at 036a00d): the same names, o_proj bias
#   with `attention_bias`, `rope_theta` defaulting to 1e6 when absent.
ENGINE_LAYER_TENSORS = [
    "input_layernorm.weight",
    "mlp.down_proj.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "post_attention_layernorm.weight",
    "self_attn.k_norm.weight",
    "self_attn.k_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.q_proj.weight",
    "self_attn.v_proj.weight",
]
ENGINE_TOP_TENSORS = ["fc.weight", "hidden_norm.weight", "norm.weight"]
ENGINE_CONFIG_KEYS = {
    "architectures", "model_type", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "rms_norm_eps", "hidden_act", "attention_bias", "vocab_size",
    "max_position_embeddings", "rope_theta", "rope_scaling", "num_hidden_layers",
    "num_target_layers", "block_size", "layer_types", "sliding_window", "use_sliding_window",
    "tie_word_embeddings", "dflash_config",
}  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Trainer, Path]:
    raw = {k: dict(v) for k, v in RAW.items()}
    raw["demo"]["folder"] = str(tmp_path_factory.mktemp("assets"))
    out = tmp_path_factory.mktemp("run")
    trainer = Trainer(config_from_dict(raw), out, emit=lambda _: None)
    trainer.run()
    return trainer, out


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory: pytest.TempPathFactory) -> Path:
    trainer, out = run
    folder = tmp_path_factory.mktemp("exports") / "drafter"
    export(trainer.config, out, folder, dtype="fp32")
    return folder


def block_logits(drafter, target, features, ids, anchors):
    valid = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        hidden = drafter(features, ids, anchors, valid, target.embed_weight)  # (1, N, B, H)
    return hidden.double() @ target.lm_head_weight.double().T


def test_round_trip_equal_block_logits_and_tau(run, exported) -> None:
    trainer, _ = run
    target = trainer.source.target
    trained = trainer.drafter_worker.drafter.eval()
    loaded, cfg = load_folder(exported)
    assert cfg["dflash_config"]["target_layer_ids"] == target.layers
    ids = torch.tensor([load_samples(trainer.config.data.path)[0].input_ids[:32]])
    features = target(ids).features
    anchors = torch.tensor([[3, 9, 17, 25]])
    want = block_logits(trained, target, features, ids, anchors)
    got = block_logits(loaded, target, features, ids, anchors)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6
    prompts = [prompt_of_sample(s) for s in load_samples(trainer.config.data.path)]

    def tau(drafter) -> float:
        block = DFlashDrafter(
            drafter, embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight
        )
        return evaluate(target, block, prompts, max_new_tokens=20, check_lossless=False).tau

    assert tau(loaded) == tau(trained) > 1.0


def test_config_keys_and_values_follow_the_drafter(run, exported) -> None:
    trainer, _ = run
    cfg = json.loads((exported / "config.json").read_text())
    assert set(cfg) >= ENGINE_CONFIG_KEYS
    s = trainer.drafter_worker.drafter.shape
    tcfg = trainer.source.target.config
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        64,
        2,
        1,
    )
    assert (cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == (32, 128, 512)
    assert cfg["rms_norm_eps"] == tcfg.rms_norm_eps and cfg["hidden_act"] == "silu"
    assert cfg["rope_theta"] == tcfg.rope_parameters["rope_theta"] and cfg["rope_scaling"] is None
    assert cfg["max_position_embeddings"] == tcfg.max_position_embeddings
    assert cfg["num_hidden_layers"] == 2 and cfg["num_target_layers"] == 4
    assert cfg["block_size"] == 4 and cfg["tie_word_embeddings"] is False
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"]
    assert cfg["sliding_window"] == 6 and cfg["use_sliding_window"] is True
    assert cfg["dflash_config"] == {
        "target_layer_ids": default_target_layers(4, 2),
        "mask_token_id": s.mask_token_id,
    }
    ids = cfg["dflash_config"]["target_layer_ids"]
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in ids]  # vLLM's numbering
    assert cfg["dflash_trainer"]["drafter_format"] == DRAFTER_FORMAT
    assert cfg["dflash_trainer"]["step"] == RAW["run"]["steps"]
    assert all(v is not None for k, v in cfg.items() if k not in ("rope_scaling",))


def test_tensor_names_are_the_engines(exported) -> None:
    from safetensors import safe_open

    with safe_open(str(exported / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
        dtypes = {fh.get_tensor(n).dtype for n in names}
    want = {f"layers.{i}.{n}" for i in range(2) for n in ENGINE_LAYER_TENSORS}
    assert names == want | set(ENGINE_TOP_TENSORS)
    assert dtypes == {torch.float32}
    assert not any("embed" in n or "lm_head" in n for n in names)


def test_default_dtype_is_bf16_and_sizes_halve(run, tmp_path, exported) -> None:
    trainer, out = run
    folder = export(trainer.config, out, tmp_path / "bf16")
    assert json.loads((folder / "config.json").read_text())["torch_dtype"] == "bfloat16"
    full = (exported / "model.safetensors").stat().st_size
    assert (folder / "model.safetensors").stat().st_size < 0.6 * full


def test_refuses_an_existing_folder_and_other_settings(run, exported) -> None:
    trainer, out = run
    with pytest.raises(ExportRefused, match="exists"):
        export(trainer.config, out, exported)
    other = config_from_dict(
        {**RAW, "demo": {**RAW["demo"], "folder": "x"}}, ["model.block_size=5"]
    )
    with pytest.raises(ExportRefused, match="model.block_size"):
        export(other, out, exported.parent / "other")
    assert not (exported.parent / "other").exists()


def as_format_1(out: Path) -> Path:
    """The run's checkpoint, its manifest rewritten as an earlier trainer wrote it."""
    path = ckpt.find_resumable(out).path
    assert path is not None
    raw = json.loads((path / ckpt.MANIFEST).read_text())
    raw.pop("drafter_format")
    (path / ckpt.MANIFEST).write_text(json.dumps(raw))
    return path


def test_refuses_a_format_1_checkpoint_served_differently(run, tmp_path) -> None:
    trainer, out = run
    copy = tmp_path / "run"
    subprocess.run(["cp", "-r", str(out), str(copy)], check=True)
    as_format_1(copy)
    with pytest.raises(ExportRefused, match="sliding-window layers") as info:
        export(trainer.config, copy, tmp_path / "x")
    assert "Train it again" in str(info.value) and not (tmp_path / "x").exists()


def test_a_format_1_qwen3_full_attention_drafter_exports(tmp_path) -> None:
    raw = {k: dict(v) for k, v in RAW.items()}
    raw["demo"]["folder"] = str(tmp_path / "assets")
    raw["model"] = {"num_layers": 1, "block_size": 4, "num_target_layers": 2}
    raw["run"] = {**raw["run"], "steps": 1}
    trainer = Trainer(config_from_dict(raw), tmp_path / "run", emit=lambda _: None)
    trainer.run()
    as_format_1(tmp_path / "run")
    folder = export(trainer.config, tmp_path / "run", tmp_path / "out")
    assert (folder / "model.safetensors").is_file()


def test_tensor_mismatch_is_refused(run) -> None:
    trainer, _ = run
    drafter = trainer.drafter_worker.drafter
    state = dict(drafter.state_dict())
    state.pop("layers.1.self_attn.k_norm.weight")
    state["lm_head.weight"] = torch.zeros(1)
    with pytest.raises(DrafterFolderError, match="k_norm"):
        hf_tensors(drafter.shape, state, torch.float32)


def test_a_folder_missing_a_key_is_refused(exported, tmp_path) -> None:
    shutil.copytree(exported, tmp_path / "d")
    cfg = json.loads((exported / "config.json").read_text())
    for key, message in [("dflash_config", "dflash_config"), ("sliding_window", "sliding_window")]:
        broken = (
            {**cfg, key: None}
            if key == "sliding_window"
            else {k: v for k, v in cfg.items() if k != key}
        )
        (tmp_path / "d" / "config.json").write_text(json.dumps(broken))
        with pytest.raises(DrafterFolderError, match=message):
            load_folder(tmp_path / "d")


def test_a_failed_write_leaves_nothing(tmp_path) -> None:
    out = tmp_path / "drafter"
    with pytest.raises(TypeError):
        write_folder(out, {"fc.weight": torch.ones(2)}, {"bad": object()})
    assert list(tmp_path.iterdir()) == []


def run_verb(verb: str, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m trainer VERB …`, as the place runs it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "trainer", verb, *args],
        capture_output=True, text=True, env=env, timeout=240,
    )  # fmt: skip


def served_by(lines: list[str], engine: str) -> list[str]:
    """The argv of the command line `python -m trainer export` printed for `engine`."""
    return shlex.split(next(x for x in lines if x.startswith(f"  {engine}: ")).split(": ", 1)[1])


def write_toml(raw: dict, path: Path) -> Path:
    lines = []
    for name, values in raw.items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_entry_points_export_and_evaluate_the_folder(run, tmp_path) -> None:
    trainer, out = run
    raw = {k: dict(v) for k, v in RAW.items()}
    raw["demo"]["folder"] = trainer.config.demo.folder
    cfg = write_toml(raw, tmp_path / "c.toml")
    proc = run_verb("export", "--config", str(cfg), "--checkpoint", str(out),
                      "--out", str(tmp_path / "d"), "--dtype", "fp32")  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == str(tmp_path / "d")
    assert lines[1] == "Serve it (B = 4, so vLLM's num_speculative_tokens = 3):"
    assert served_by(lines, "vLLM") == [
        "vllm", "serve", trainer.config.model.target, "--speculative-config",
        json.dumps({"method": "dflash", "model": str(tmp_path / "d"), "num_speculative_tokens": 3}),
    ]  # fmt: skip
    sglang = served_by(lines, "SGLang")
    assert sglang[sglang.index("--speculative-num-draft-tokens") + 1] == "4"
    assert sglang[sglang.index("--speculative-draft-model-path") + 1] == str(tmp_path / "d")
    prompts = tmp_path / "p.jsonl"
    rows = load_samples(trainer.config.data.path)[:3]
    prompts.write_text("".join(json.dumps({"input_ids": r.input_ids[:6]}) + "\n" for r in rows))
    common = ["--config", str(cfg), "--prompts", str(prompts), "--max-new-tokens", "12", "--json"]
    by_folder = run_verb("evaluate", *common, "--drafter", str(tmp_path / "d"))
    by_ckpt = run_verb("evaluate", *common, "--checkpoint", str(out))
    assert by_folder.returncode == 0 and by_ckpt.returncode == 0, by_folder.stderr
    assert json.loads(by_folder.stdout)["tau"] == json.loads(by_ckpt.stdout)["tau"]
    again = run_verb("export", "--config", str(cfg), "--checkpoint", str(out),
                       "--out", str(tmp_path / "d"))  # fmt: skip
    assert again.returncode == 2 and "exists" in again.stderr


def test_the_entry_point_checks_an_engine_report_of_the_folder(run, tmp_path) -> None:
    """`trainer.evaluation.evaluate --engine-report`: a report of what the project decodes with the folder
    agrees (exit 0); one accepted count changed parts at its request and step (exit 1)."""
    trainer, out = run
    raw = {k: dict(v) for k, v in RAW.items()}
    raw["demo"]["folder"] = trainer.config.demo.folder
    cfg = write_toml(raw, tmp_path / "c.toml")
    folder = export(trainer.config, out, tmp_path / "d", dtype="fp32")
    target = trainer.source.target
    loaded, _ = load_folder(folder)
    block = DFlashDrafter(
        loaded, embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight
    )
    prompts = [s.input_ids[:6] for s in load_samples(trainer.config.data.path)[:3]]
    decoded = speculative_decode_many(target, block, prompts, 12, eos=[])
    requests = [
        EngineRequest(p, d.tokens, 12, d.accepted, 3) for p, d in zip(prompts, decoded, strict=True)
    ]
    args = ["--config", str(cfg), "--drafter", str(folder), "--engine-report"]
    agree = run_verb("evaluate", *args, str(write_report(tmp_path / "r.jsonl", requests)))
    assert agree.returncode == 0, agree.stderr
    assert "acceptance: 3/3 requests equal step for step" in agree.stdout
    assert agree.stdout.rstrip().endswith("engine and project agree")
    changed = list(requests[1].accepted or [])
    changed[0] = (changed[0] + 1) % 4
    requests[1] = replace(requests[1], accepted=changed)
    part = run_verb("evaluate", *args, str(write_report(tmp_path / "p.jsonl", requests)))
    assert part.returncode == 1, part.stderr
    assert (
        f"request 1: acceptance parts at verify step 0 (engine accepted {changed[0]}" in part.stdout
    )


@pytest.mark.parametrize(
    ("key", "value", "config_key", "weight"),
    [
        ("intermediate_size", 96, "intermediate_size", "layers.0.mlp.up_proj.weight"),
        ("num_kv_heads", 2, "num_key_value_heads", "layers.0.self_attn.k_proj.weight"),
        ("num_heads", 8, "num_attention_heads", "layers.0.self_attn.q_proj.weight"),
        ("head_dim", 8, "head_dim", "layers.0.self_attn.o_proj.weight"),
    ],
)
def test_a_drafter_of_its_own_shape_exports_and_reads_back(
    tmp_path, key: str, value: int, config_key: str, weight: str
) -> None:
    """`model.intermediate_size` / `model.num_kv_heads` (not the target's 128 / 1) are the
    folder's `intermediate_size` / `num_key_value_heads`, the keys the engines build the MLP and
    the attention from; read back, the drafter drafts the same; exporting its checkpoint with a
    config without the key is refused by name."""
    raw = {k: dict(v) for k, v in RAW.items()}
    raw["demo"]["folder"] = str(tmp_path / "assets")
    raw["model"] = {**raw["model"], key: value}
    raw["run"] = {**raw["run"], "steps": 2}
    trainer = Trainer(config_from_dict(raw), tmp_path / "run", emit=lambda _: None)
    trainer.run()
    folder = export(trainer.config, tmp_path / "run", tmp_path / "out", dtype="fp32")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg[config_key] == value != getattr(trainer.source.target.config, config_key)
    loaded, _ = load_folder(folder)
    assert (
        loaded.state_dict()[weight].shape
        == trainer.drafter_worker.drafter.state_dict()[weight].shape
    )
    target = trainer.source.target
    ids = torch.tensor([load_samples(trainer.config.data.path)[0].input_ids[:32]])
    anchors = torch.tensor([[3, 9, 17, 25]])
    trained = trainer.drafter_worker.drafter.eval()
    want = block_logits(trained, target, target(ids).features, ids, anchors)
    got = block_logits(loaded, target, target(ids).features, ids, anchors)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-6
    raw["model"].pop(key)
    with pytest.raises(ExportRefused, match=f"model.{key}"):
        export(config_from_dict(raw), tmp_path / "run", tmp_path / "other")
