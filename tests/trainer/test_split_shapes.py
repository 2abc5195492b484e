"""The default split of a node from the model shapes (`trainer.split.split_shapes`): the two records
the split was measured on, built as configs, get the split their measured rates make best, and
a split run without `DFLASH_TARGET_GPUS` runs and says it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from trainer.settings.config import TrainConfig
from trainer.settings.loading import config_from_dict
from trainer.split.split_rule import default_target_gpus, predict_splits, target_gpus_for_work
from trainer.split.split_shapes import RoleWork, role_work

# bench/results/seed-size/README.md: a Qwen3.6-27B-shaped hybrid target and its published drafter
# (5 layers, four sliding-window of 2,048, 32 heads of 128, 8 key/value heads), one sequence of
# 49,152 tokens with 2,048 blocks of 16, KL on
SEED_TARGET = dict(
    vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64,
    full_attention_interval=4, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=262144,
)  # fmt: skip
SEED_RUN = {
    "model": {"num_layers": 5, "num_heads": 32, "head_dim": 128, "num_kv_heads": 8,
              "sliding_window": 2048, "sliding_layers": [0, 1, 2, 3], "block_size": 16},
    "data": {"max_len": 49152, "num_anchors": 2048, "bucket": 128},
}  # fmt: skip
# bench/results/split/README.md: a Qwen3-8B-shaped target, a 5-layer drafter shaped as the target,
# sequences of 4,096 tokens with 512 blocks of 16, KL on
QWEN3_8B = dict(
    vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
)  # fmt: skip
QWEN3_8B_RUN = {
    "model": {"num_layers": 5, "block_size": 16},
    "data": {"max_len": 4096, "num_anchors": 512, "bucket": 128},
}
# the rates each record measured, one H200 a role: (r_target, r_drafter) tokens/s
MEASURED = {"seed": (8_009.0, 40_236.0), "qwen3-8b": (30_156.0, 24_982.0)}


def run_config(tables: dict) -> TrainConfig:
    model = {"target": "in-memory", **tables["model"]}
    return config_from_dict({**tables, "model": model, "data": {"path": "x", **tables["data"]}})


@pytest.fixture(scope="module")
def work() -> dict[str, RoleWork]:
    """Each record's work per token, from its shapes only."""
    pytest.importorskip("transformers.models.qwen3_5", reason="transformers without Qwen3.5")
    from transformers import AutoConfig, Qwen3Config

    rope = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    seed = AutoConfig.for_model("qwen3_5_text", **SEED_TARGET, rope_parameters=rope, pad_token_id=0)
    qwen3 = Qwen3Config(**QWEN3_8B, max_position_embeddings=8192, pad_token_id=0)
    return {
        "seed": role_work(run_config(SEED_RUN), seed),
        "qwen3-8b": role_work(run_config(QWEN3_8B_RUN), qwen3),
    }


def test_the_records_shapes_get_the_split_their_measured_rates_make_best(work) -> None:
    """On 8 GPUs: 6 + 2 for the 27B-shaped target (⌊G/2⌋ = 4 + 4 predicts a third less there),
    4 + 4 for the 8B-shaped one, as the rates measured on H200s put them."""
    assert work["seed"].target_gpus(8) == 6
    assert work["qwen3-8b"].target_gpus(8) == 4
    for name, targets in (("seed", 6), ("qwen3-8b", 4)):
        splits = {s.targets: s.tokens_per_s for s in predict_splits(*MEASURED[name], 8)}
        assert max(splits, key=lambda t: splits[t]) == targets, name
    seed = {s.targets: s.tokens_per_s for s in predict_splits(*MEASURED["seed"], 8)}
    assert seed[default_target_gpus(8)] < 0.7 * seed[6]


def test_the_work_is_the_records_own_count(work) -> None:
    """The target's FLOPs are those the 27B record counted for its 49,152-token forward
    (bench/results/seed-size/summary.json); the drafter's, from a sequence supervised
    throughout, stay within 1 % of the records' batches (whose first 1/32 is a prompt)."""
    seed, qwen3 = work["seed"], work["qwen3-8b"]
    assert seed.target_flops * 49152 == 2889667955392512.0
    assert seed.drafter_flops * 49152 == pytest.approx(642288500932608.0, rel=0.01)
    assert qwen3.drafter_flops * 4096 == pytest.approx(82.3e12, rel=0.01)
    assert qwen3.target_flops < qwen3.drafter_flops < 4 / 3 * qwen3.target_flops


@pytest.mark.parametrize("name", sorted(MEASURED))
def test_the_default_is_near_the_best_at_the_measured_rates(work, name: str) -> None:
    """From 2 to 16 GPUs the default predicts at least 96 % of the best split's rate at the
    rates each record measured (the roles' share of the peak differs a little)."""
    w = work[name]
    for gpus in range(2, 17):
        splits = {s.targets: s.tokens_per_s for s in predict_splits(*MEASURED[name], gpus)}
        assert splits[w.target_gpus(gpus)] >= 0.96 * max(splits.values()), gpus


def test_flops_are_said_in_three_digits_and_a_unit() -> None:
    from trainer.split.split_shapes import flop_text

    got = [flop_text(x) for x in (58.79e9, 13.04e9, 155_904.0, 1.5e12, 999.0)]
    assert got == ["58.8 GFLOP", "13.0 GFLOP", "156 kFLOP", "1.50 TFLOP", "999 FLOP"]


def test_equal_work_splits_as_no_model_does() -> None:
    """Equal work per token ties an odd G between ⌊G/2⌋ and one more target: the fewer."""
    assert [target_gpus_for_work(g, 5.0, 5.0) for g in range(0, 10)] == [
        default_target_gpus(g) for g in range(0, 10)
    ]
    assert target_gpus_for_work(8, 6.0, 1.0) == 6 and target_gpus_for_work(8, 1.0, 6.0) == 1
    with pytest.raises(ValueError, match="work per token"):
        target_gpus_for_work(8, 0.0, 1.0)


def test_roles_without_target_gpus_take_the_shapes_default(tmp_path: Path, caplog) -> None:
    """`trainer.commands.train`'s call on a tiny demo config: every rank gets the same split, rank 0
    says where it comes from, once; `DFLASH_TARGET_GPUS` still wins, and no config (no
    model) is ⌊G/2⌋."""
    from tests.trainer.test_split import write_config
    from trainer.settings.loading import load_config
    from trainer.split.roles import roles_from_env

    config = load_config(write_config(tmp_path / "c.toml", tmp_path / "assets"))
    work = role_work(config)
    assert work.target_gpus(3) == 2 != default_target_gpus(3)  # the demo's target costs more
    caplog.set_level(logging.INFO, logger="trainer")
    roles = [roles_from_env({"WORLD_SIZE": "3", "RANK": str(r)}, config=config) for r in range(3)]
    assert [r.role for r in roles if r] == ["target", "target", "drafter"]
    said = [rec.getMessage() for rec in caplog.records if "default split" in rec.getMessage()]
    assert said == [f"{work.describe(3)}; DFLASH_TARGET_GPUS ([job] target_gpus) sets another"]
    assert said[0].startswith("default split 2 + 1 of 3 GPUs") and "kFLOP, drafter" in said[0]
    caplog.clear()
    env = {"WORLD_SIZE": "3", "RANK": "0"}
    given = roles_from_env({**env, "DFLASH_TARGET_GPUS": "1"}, config=config)
    no_model = roles_from_env(env)
    assert given is not None and no_model is not None
    assert given.num_targets == no_model.num_targets == 1
    assert not caplog.records
