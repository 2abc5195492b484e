"""Config: TOML + overrides, typed parsing, errors naming the key, stable hash."""

from __future__ import annotations

import pytest

from trainer.settings.config import TrainConfigError, diff_settings
from trainer.settings.loading import load_config

BASE = """
[model]
target = "/models/t"
block_size = 10
[data]
path = "/data/train.jsonl"
num_anchors = 64
"""


def test_load_and_override(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(BASE)
    cfg = load_config(path, ["optim.lr=3e-4", "model.target_layers=[1, 3]", "run.device=cpu"])
    assert cfg.optim.lr == 3e-4 and cfg.model.target_layers == [1, 3] and cfg.run.device == "cpu"
    assert cfg.model.block_size == 10 and cfg.loss.resolved_gamma(10) == 10.0
    assert cfg.loss.kl_weight == 0.15 and load_config(path).loss.resolved_gamma(16) == 7.0
    assert load_config(path, ["model.mask_token_id=none"]).model.mask_token_id is None
    assert load_config(path, ["optim.warmup_steps=3"]).optim.warmup_steps == 3


def test_deploy_toml_train_table(tmp_path) -> None:
    path = tmp_path / "deploy.toml"
    path.write_text('[place]\nkind = "local"\n[train]\ndemo = true\n[train.run]\nsteps = 7\n')
    cfg = load_config(path)
    assert cfg.demo.enabled and cfg.run.steps == 7


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("optim.lrr=1", "optim.lrr"),
        ("nope.x=1", "nope.x"),
        ("optim.lr=fast", "optim.lr"),
        ("run.steps=1.5", "run.steps"),
        ("data.shuffle=1", "data.shuffle"),
        ("model.block_size=1", "model.block_size"),
        ("model.sliding_layers=[7]", "model.sliding_layers"),
        ("loss.kl_weight=2", "loss.kl_weight"),
        ("run.compile=maybe", "run.compile"),
        ("run.compile_target=1", "run.compile_target"),
        ("split.timeout_s=0", "split.timeout_s"),
        ("split.heartbeat_timeout_s=-1", "split.heartbeat_timeout_s"),
        ("split.max_in_flight=0", "split.max_in_flight"),
        ("split.max_in_flight=1.5", "split.max_in_flight"),
        ("split.timeout=5", "split.timeout"),
    ],
)
def test_errors_name_the_key(tmp_path, override: str, key: str) -> None:
    path = tmp_path / "c.toml"
    path.write_text(BASE)
    with pytest.raises(TrainConfigError) as err:
        load_config(path, [override])
    assert err.value.key == key and key in str(err.value)


def test_compile_defaults_to_cuda_only_and_leaves_the_checkpoint_hash(tmp_path) -> None:
    import torch

    path = tmp_path / "c.toml"
    path.write_text(BASE)
    auto, off, on = (
        load_config(path, o) for o in ([], ["run.compile=false"], ["run.compile=true"])
    )
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 1)
    assert (auto.run.compiles_on(cpu), auto.run.compiles_on(cuda)) == (False, True)
    assert (off.run.compiles_on(cuda), on.run.compiles_on(cpu)) == (False, True)
    assert auto.model_data_hash() == off.model_data_hash() == on.model_data_hash()


def test_target_compile_defaults_to_cuda_only_and_dense_targets(tmp_path) -> None:
    import torch

    path = tmp_path / "c.toml"
    path.write_text(BASE)
    overrides = ([], ["run.compile_target=false"], ["run.compile_target=true"])
    auto, off, on = (load_config(path, o) for o in overrides)
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 1)
    assert (auto.run.compiles_target_on(cpu), auto.run.compiles_target_on(cuda)) == (False, True)
    assert (off.run.compiles_target_on(cuda), on.run.compiles_target_on(cpu)) == (False, True)
    assert auto.model_data_hash() == off.model_data_hash() == on.model_data_hash()
    # a target with linear-attention layers stays eager unless the key asks for the compile
    hybrid = {"linear_attention": True}
    assert not auto.run.compiles_target_on(cuda, **hybrid)
    assert on.run.compiles_target_on(cuda, **hybrid)


def test_missing_target_named(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[data]\npath = 'x'\n")
    with pytest.raises(TrainConfigError, match="model.target"):
        load_config(path)


def test_hash_covers_model_and_data_only(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(BASE)
    a = load_config(path)
    assert (
        a.model_data_hash() == load_config(path, ["optim.lr=1e-3", "run.steps=5"]).model_data_hash()
    )
    b = load_config(path, ["model.num_layers=3", "data.num_anchors=32"])
    assert a.model_data_hash() != b.model_data_hash()
    assert diff_settings(a.model_data_settings(), b.model_data_settings()) == [
        "data.num_anchors",
        "model.num_layers",
    ]


def test_demo_alone_is_the_demo_config(tmp_path) -> None:
    from pathlib import Path

    demo_toml = Path(__file__).resolve().parents[2] / "trainer" / "configs" / "demo.toml"
    path = tmp_path / "deploy.toml"
    path.write_text("[train]\ndemo = true\n")
    assert load_config(path) == load_config(demo_toml)
    cfg = load_config(path, ["run.steps=5", "model.block_size=4"])
    assert cfg.run.steps == 5 and cfg.model.block_size == 4 and cfg.run.device == "cpu"


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("data.enable_thinking", False),
        ("data.system_prompt", "x"),
        ("model.intermediate_size", 64),
        ("model.num_kv_heads", 4),
    ],
)
def test_later_keys_tie_checkpoints_only_when_set(key: str, value: object) -> None:
    """Checkpoints written before data.enable_thinking, data.system_prompt,
    model.intermediate_size and model.num_kv_heads existed still resume while those keys keep their defaults; setting
    one changes the model/data settings."""
    from trainer.settings.loading import config_from_dict

    base = {"model": {"target": "/m"}, "data": {"path": "/d.jsonl"}}
    plain = config_from_dict(base)
    later = {
        "data.enable_thinking",
        "data.system_prompt",
        "model.intermediate_size",
        "model.num_kv_heads",
    }
    assert not later & set(plain.model_data_settings())
    section, name = key.split(".")
    changed = config_from_dict({**base, section: {**base[section], name: value}})
    assert changed.model_data_settings()[key] == value
    assert changed.model_data_hash() != plain.model_data_hash()


def test_split_table_is_saved_with_the_checkpoint_and_old_checkpoints_resume(tmp_path) -> None:
    """`[split]` is read from the file and kept in the checkpoint's manifest; it is not a
    model/data setting, so a checkpoint written before the table existed, or with other
    values, still resumes."""
    import json

    from trainer.model import checkpoint as ckpt
    from trainer.split.distributed import Timeouts

    path = tmp_path / "c.toml"
    path.write_text(BASE + "[split]\ntimeout_s = 90\nmax_in_flight = 4\n")
    cfg = load_config(path)
    assert (cfg.split.timeout_s, cfg.split.heartbeat_timeout_s, cfg.split.max_in_flight) == (
        90.0,
        60.0,
        4,
    )
    assert Timeouts.of(cfg.split) == Timeouts(wait_s=90.0, heartbeat_s=60.0)
    run = tmp_path / "run"
    ckpt.save_checkpoint(run, 3, {"step": 3}, cfg, keep_last=2, resolved=None)
    manifest = run / "step-00000003" / "manifest.json"
    raw = json.loads(manifest.read_text())
    assert raw["resolved"]["split.timeout_s"] == 90.0
    assert raw["resolved"]["split.max_in_flight"] == 4
    raw["resolved"] = {k: v for k, v in raw["resolved"].items() if not k.startswith("split.")}
    manifest.write_text(json.dumps(raw))  # as written before the table existed
    base = tmp_path / "base.toml"
    base.write_text(BASE)
    for other in (load_config(base), load_config(path, ["split.max_in_flight=1"])):
        found = ckpt.find_resumable(run)
        assert found.path == run / "step-00000003"
        assert ckpt.check_compatible(found, other) == []
