"""The drafter follows the target's settings the engines can serve, or refuses by name: q/k
norm for a Llama target, attention bias on q, k, v and o, the target's rope (llama3 and linear
scaling equal to transformers' own), a whole-head rope for a target that rotates part of each
head, and refusals of GELU, MLP bias, yarn."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from trainer.base.errors import UnsupportedTarget
from trainer.export.hf_format import hf_config
from trainer.model.drafter import Drafter, check_target_supported, shape_from_target
from trainer.model.rope import RopeSpec, inv_freq
from trainer.settings.config import ModelConfig

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1024,
}


def llama(**kw) -> LlamaConfig:
    base = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    kw = {k: dict(v) if isinstance(v, dict) else v for k, v in kw.items()}  # it edits dicts
    return LlamaConfig(**{**base, **kw})


def drafter_for(config, **model_kw) -> Drafter:
    model = ModelConfig(target="t", num_layers=1, block_size=4, **model_kw)
    return Drafter(shape_from_target(config, model, num_features=2))


def test_llama_target_gets_qk_norm_and_its_rope() -> None:
    drafter = drafter_for(llama(rope_scaling=LLAMA3))
    names = set(drafter.state_dict())
    assert {"layers.0.self_attn.q_norm.weight", "layers.0.self_attn.k_norm.weight"} <= names
    rope = drafter.shape.rope
    assert rope.rope_type == "llama3" and rope.theta == 500000.0
    assert rope.scaling_dict() == LLAMA3


@pytest.mark.parametrize("scaling", [LLAMA3, {"rope_type": "linear", "factor": 4.0}, None])
def test_inverse_frequencies_equal_transformers(scaling) -> None:
    config = llama(rope_scaling=scaling)
    spec = shape_from_target(config, ModelConfig(target="t"), num_features=1).rope
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        want = 1.0 / 500000.0 ** (torch.arange(0, 16, 2).double() / 16)
    else:
        want, factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
        assert factor == 1.0  # no attention scaling for these types
    torch.testing.assert_close(inv_freq(spec, 16).double(), want.double(), rtol=1e-6, atol=0)
    if kind == "llama3":  # long wavelengths really are scaled, short ones kept
        plain = inv_freq(RopeSpec(theta=500000.0), 16)
        got = inv_freq(spec, 16)
        assert got[0] == plain[0] and torch.isclose(got[-1], plain[-1] / 8)


def test_attention_bias_is_on_q_k_v_and_o() -> None:
    drafter = drafter_for(llama(attention_bias=True))
    attn = drafter.layers[0].self_attn
    assert all(p.bias is not None for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
    assert drafter_for(llama()).layers[0].self_attn.o_proj.bias is None


@pytest.mark.parametrize(
    "config,field",
    [
        (llama(hidden_act="gelu"), "hidden_act"),
        (llama(mlp_bias=True), "mlp_bias"),
        (llama(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling.rope_type"),
        (llama(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling.rope_type"),
        (Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2), None),
    ],
)
def test_refused_by_field_name(config, field) -> None:
    if field is None:
        check_target_supported(config)
        return
    with pytest.raises(UnsupportedTarget) as info:
        drafter_for(config)
    assert info.value.field == field and field in str(info.value)


def test_a_partial_rotary_target_gets_a_drafter_that_rotates_its_whole_head() -> None:
    """The drafter's rope is its own (its queries and keys are its own projections): it takes
    the target's theta and rotates every pair of the head, as the engines build it from the
    exported config, whatever share of the head the target rotates (Qwen3.5: a quarter)."""
    config = llama()
    config.partial_rotary_factor = 0.25
    shape = drafter_for(config).shape
    assert shape.rope == RopeSpec(theta=500000.0)
    assert inv_freq(shape.rope, shape.head_dim).shape == (shape.head_dim // 2,)
    served = hf_config(shape, target_layer_ids=[1, 2], num_target_layers=6,
                       max_position_embeddings=8192, dtype=torch.float32)  # fmt: skip
    assert "partial_rotary_factor" not in json.dumps(served)


def test_llama_drafter_runs_forward() -> None:
    torch.manual_seed(0)
    drafter = drafter_for(llama(rope_scaling=LLAMA3, attention_bias=True)).eval()
    feats = torch.randn(1, 20, 2 * 64)
    ids = torch.randint(0, 300, (1, 20))
    out = drafter(feats, ids, torch.tensor([[5, 12]]), torch.ones(1, 2, dtype=torch.bool),
                  torch.randn(300, 64))  # fmt: skip
    assert out.shape == (1, 2, 4, 64) and torch.isfinite(out).all()


def test_resuming_a_drafter_without_qk_norm_is_refused() -> None:
    """A format-1 drafter of a Llama target had no q/k norms: resuming it names the tensors."""
    from dataclasses import replace

    from trainer.base.errors import TrainerError
    from trainer.run.pipeline import DrafterWorker
    from trainer.settings.loading import config_from_dict

    shape = drafter_for(llama()).shape
    old = Drafter(replace(shape, qk_norm=False))
    config = config_from_dict({"model": {"target": "t"}, "data": {"path": "d"}})
    embed = torch.zeros(300, 64)
    worker = DrafterWorker.for_config(
        shape, config, torch.device("cpu"), embed_weight=embed, lm_head_weight=embed
    )
    state = worker.state_dict()
    state["drafter"] = old.state_dict()
    with pytest.raises(TrainerError, match="q_norm") as info:
        worker.load_state_dict(state)
    assert "new run folder" in str(info.value)
