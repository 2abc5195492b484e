"""Drafter: shapes, what a block may see (nothing at or after its anchor, nothing of another
block), the mask token check, and target loading through save_pretrained/from_pretrained."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.model.drafter import Drafter, shape_from_target
from trainer.model.target import default_target_layers, load_target
from trainer.settings.config import ModelConfig, TrainConfigError

V, H, B = 97, 32, 4


def tiny_target_config(layers: int = 6) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        pad_token_id=3,
    )


def make_drafter(**model_kw) -> Drafter:
    torch.manual_seed(0)
    model = ModelConfig(target="t", num_layers=2, block_size=B, **model_kw)
    return Drafter(shape_from_target(tiny_target_config(), model, num_features=3)).eval()


def inputs(seq: int = 24, n: int = 3):
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(2, seq, 3 * H, generator=gen)
    ids = torch.randint(0, V, (2, seq), generator=gen)
    anchors = torch.tensor([[4, 9, 15], [2, 11, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    embed = torch.randn(V, H, generator=gen)
    return features, ids, anchors[:, :n], valid[:, :n], embed


def test_forward_shape_and_shape_from_target() -> None:
    drafter = make_drafter()
    s = drafter.shape
    assert (s.num_heads, s.num_kv_heads, s.head_dim, s.intermediate_size) == (4, 2, 8, 64)
    assert s.qk_norm and s.mask_token_id == 3 and s.rope.theta == 10000.0
    out = drafter(*inputs())
    assert out.shape == (2, 3, B, H) and torch.isfinite(out).all()
    assert drafter.fc.weight.shape == (H, 3 * H)


def test_the_mlp_width_is_the_targets_unless_set() -> None:
    drafter = make_drafter(intermediate_size=40)
    assert drafter.shape.intermediate_size == 40
    assert drafter.layers[1].mlp.down_proj.weight.shape == (H, 40)
    assert torch.isfinite(drafter(*inputs())).all()
    with pytest.raises(TrainConfigError, match="model.intermediate_size: must be > 0"):
        ModelConfig(target="t", intermediate_size=0)


def test_the_key_value_heads_are_the_targets_unless_set() -> None:
    """`model.num_kv_heads`: a wider (or narrower) channel from the target's features than the
    target's own GQA; any divisor of the heads, anything else refused with the choices."""
    for kv in (4, 1):
        drafter = make_drafter(num_kv_heads=kv)
        assert drafter.shape.num_kv_heads == kv
        assert drafter.layers[0].self_attn.v_proj.weight.shape == (kv * 8, H)
        assert torch.isfinite(drafter(*inputs())).all()
    with pytest.raises(TrainConfigError, match="3 does not divide the target's 4 attention heads: "
                       "pick one of 1, 2, 4"):  # fmt: skip
        make_drafter(num_kv_heads=3)
    with pytest.raises(TrainConfigError, match="model.num_kv_heads: must be > 0"):
        ModelConfig(target="t", num_kv_heads=0)


def test_the_heads_and_head_dimension_are_the_targets_unless_set() -> None:
    """`model.num_heads` / `model.head_dim`: a drafter of its own attention shape (a published
    drafter for a target of 24 heads of 256 has 32 heads of 128); the target's key/value heads
    must then divide the new heads, or `model.num_kv_heads` is named."""
    drafter = make_drafter(num_heads=8, head_dim=4)
    s = drafter.shape
    assert (s.num_heads, s.num_kv_heads, s.head_dim) == (8, 2, 4)
    attn = drafter.layers[0].self_attn
    assert attn.q_proj.weight.shape == (8 * 4, H) and attn.o_proj.weight.shape == (H, 8 * 4)
    assert attn.k_proj.weight.shape == (2 * 4, H)
    assert torch.isfinite(drafter(*inputs())).all()
    with pytest.raises(TrainConfigError, match="model.num_kv_heads: the target's 2 key/value "
                       "heads do not divide model.num_heads = 3: set model.num_kv_heads to one "
                       "of 1, 3"):  # fmt: skip
        make_drafter(num_heads=3)
    assert make_drafter(num_heads=3, num_kv_heads=1).shape.num_kv_heads == 1
    with pytest.raises(TrainConfigError, match="4 does not divide the drafter's 6 attention"):
        make_drafter(num_heads=6, num_kv_heads=4)
    for key in ("num_heads", "head_dim"):
        with pytest.raises(TrainConfigError, match=f"model.{key}: must be > 0"):
            ModelConfig(target="t", **{key: 0})


def test_describe_names_the_shape_and_counts_the_trained_parameters() -> None:
    drafter = make_drafter(intermediate_size=40)
    params = sum(p.numel() for p in drafter.parameters())
    line = drafter.describe()
    assert line.startswith("drafter: 2 layers × 32, 4 heads (2 kv) × 8, MLP 40, B = 4, ")
    assert f"; {params:,} parameters trained" in line and params < 10**6


@pytest.mark.parametrize(("sliding", "kv_heads"), [(False, None), (True, None), (False, 4)])
def test_block_sees_only_context_before_its_anchor(sliding: bool, kv_heads: int | None) -> None:
    kw = {"sliding_window": 6, "sliding_layers": [1]} if sliding else {}
    drafter = make_drafter(num_kv_heads=kv_heads, **kw)
    features, ids, anchors, valid, embed = inputs()
    base = drafter(features, ids, anchors, valid, embed)
    # perturb context features (and tokens) at and after anchor 9 (row 0, block 1): blocks 0 and
    # 1 of row 0 must not change; block 2 (anchor 15) may.
    f2, ids2 = features.clone(), ids.clone()
    f2[0, 9:] += torch.randn_like(f2[0, 9:])
    ids2[0, 10:] = (ids2[0, 10:] + 1) % V  # ids[9] is block 1's own first token: keep it
    out = drafter(f2, ids2, anchors, valid, embed)
    torch.testing.assert_close(out[0, :2], base[0, :2], rtol=0, atol=1e-6)
    assert not torch.allclose(out[0, 2], base[0, 2])
    torch.testing.assert_close(out[1], base[1], rtol=0, atol=1e-6)  # other row untouched
    # context just before the anchor is visible
    f3 = features.clone()
    f3[0, 8] += 1.0
    assert not torch.allclose(drafter(f3, ids, anchors, valid, embed)[0, 1], base[0, 1])


def test_blocks_do_not_see_each_other() -> None:
    drafter = make_drafter()
    features, ids, anchors, valid, embed = inputs()
    base = drafter(features, ids, anchors, valid, embed)
    # changing block 1's first token (x at anchor 9) through the *embedding row* of that token
    # changes block 1 only; blocks 0 and 2 read position 9 as context features, not as tokens.
    ids2 = ids.clone()
    ids2[0, 9] = (ids[0, 9] + 1) % V
    out = drafter(features, ids2, anchors, valid, embed)
    assert not torch.allclose(out[0, 1], base[0, 1])
    torch.testing.assert_close(out[0, 0], base[0, 0], rtol=0, atol=1e-6)
    torch.testing.assert_close(out[0, 2], base[0, 2], rtol=0, atol=1e-6)


def test_slot_positions_follow_anchor() -> None:
    """Moving an anchor changes its block (positions and context), and only its block."""
    drafter = make_drafter()
    features, ids, anchors, valid, embed = inputs()
    base = drafter(features, ids, anchors, valid, embed)
    moved = anchors.clone()
    moved[0, 1] = 10
    out = drafter(features, ids, moved, valid, embed)
    assert not torch.allclose(out[0, 1], base[0, 1])
    torch.testing.assert_close(out[0, 0], base[0, 0], rtol=0, atol=1e-6)


def test_bf16_autocast_forward_and_backward(monkeypatch) -> None:
    """The CUDA recipe (fp32 params, bf16 autocast, bf16 target tensors), run on the CPU.
    FlexAttention is not an autocast op: q, k, v must reach it in one dtype."""
    import trainer.model.drafter as model_module

    seen = []

    def spy(q, k, v, mask, **kw):
        seen.append((q.dtype, k.dtype, v.dtype))
        return real(q, k, v, mask, **kw)

    real = model_module.draft_attention
    monkeypatch.setattr(model_module, "draft_attention", spy)
    drafter = make_drafter().train()
    features, ids, anchors, valid, embed = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = drafter(features.bfloat16(), ids, anchors, valid, embed.bfloat16())
    assert out.shape == (2, 3, B, H) and torch.isfinite(out).all()
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen), seen
    out.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in drafter.parameters())
    ref = make_drafter()(features, ids, anchors, valid, embed)
    torch.testing.assert_close(out.float(), ref, rtol=0.1, atol=0.1)


def test_mask_token_must_be_embedding_row() -> None:
    with pytest.raises(TrainConfigError, match="model.mask_token_id") as err:
        make_drafter(mask_token_id=V)
    assert "not a row" in str(err.value)
    assert make_drafter(mask_token_id=V - 1).shape.mask_token_id == V - 1


def test_gradients_reach_drafter_params() -> None:
    drafter = make_drafter().train()
    features, ids, anchors, valid, embed = inputs()
    drafter(features, ids, anchors, valid, embed).square().mean().backward()
    for name, p in drafter.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_default_target_layers_formula() -> None:
    assert default_target_layers(64) == [1, 16, 31, 46, 61]
    assert default_target_layers(36) == [1, 9, 17, 25, 33]


def test_target_roundtrip_through_save_pretrained(tmp_path) -> None:
    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(tiny_target_config(6)).eval()
    hf.save_pretrained(str(tmp_path / "t"))
    target = load_target(tmp_path / "t", layers=[1, 3])
    assert not any(p.requires_grad for p in target.model.parameters())
    ids = torch.randint(0, V, (2, 10))
    out = target(ids)
    assert out.features.shape == (2, 10, 2 * H) and out.last_hidden.shape == (2, 10, H)
    with torch.no_grad():  # layer i = output of decoder layer i: recompute by hand
        ref = hf.model(input_ids=ids, output_hidden_states=True)
        torch.testing.assert_close(out.features[..., :H], ref.hidden_states[2])
        logits = hf(input_ids=ids).logits
    torch.testing.assert_close(
        out.last_hidden @ target.lm_head_weight.T, logits, rtol=1e-4, atol=1e-4
    )
    with pytest.raises(TrainConfigError, match="model.target_layers"):
        load_target(tmp_path / "t", layers=[5])
    with pytest.raises(TrainConfigError, match="model.target"):
        load_target(tmp_path / "missing")


@pytest.mark.parametrize("sliding", [False, True])
def test_compiled_layers_match_eager_values_and_gradients(sliding: bool) -> None:
    """Compiling the layers changes neither the outputs nor the gradients, traces each layer as
    one graph, and keeps the parameter names (checkpoints load either way)."""
    from torch._dynamo.utils import counters

    kw = {"sliding_window": 6, "sliding_layers": [1]} if sliding else {}
    eager, compiled = make_drafter(**kw).train(), make_drafter(**kw).train()
    names = [n for n, _ in compiled.named_parameters()]
    torch._dynamo.reset()
    counters.clear()
    compiled.compile_layers(backend="aot_eager")
    assert [n for n, _ in compiled.named_parameters()] == names
    features, ids, anchors, valid, embed = inputs()
    features = features.double().requires_grad_()
    eager.double(), compiled.double()
    grads = []
    for model in (eager, compiled):
        features.grad = None
        model.zero_grad()
        out = model(features, ids, anchors, valid, embed.double())
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum().backward()
        grads.append((out.detach(), features.grad.clone(), [p.grad for p in model.parameters()]))
    (out_e, fg_e, pg_e), (out_c, fg_c, pg_c) = grads
    torch.testing.assert_close(out_c, out_e, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(fg_c, fg_e, rtol=1e-10, atol=1e-12)
    for a, b in zip(pg_c, pg_e, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] >= 1


def test_compiled_layers_fail_loudly_when_their_compile_cache_is_full() -> None:
    """A layer that meets more shapes than dynamo's limit raises CompileCacheFull naming it."""
    from trainer.base.errors import CompileCacheFull

    config = torch._dynamo.config
    torch._dynamo.reset()
    with config.patch(
        recompile_limit=config.recompile_limit,
        fail_on_recompile_limit_hit=config.fail_on_recompile_limit_hit,
    ):
        drafter = make_drafter()
        drafter.compile_layers(backend="aot_eager")
        assert config.fail_on_recompile_limit_hit and config.recompile_limit >= 64
        with config.patch(recompile_limit=2):  # layer 0 (input without grad) and the others
            drafter(*inputs(seq=24))
            with pytest.raises(CompileCacheFull, match="A drafter layer was compiled") as info:
                drafter(*inputs(seq=40))
        assert "data.bucket" in str(info.value)
    torch._dynamo.reset()
