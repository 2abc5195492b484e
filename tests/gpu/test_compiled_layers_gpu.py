"""The drafter with its layers compiled (`run.compile`, on by default on CUDA) against the same
drafter eager, on a GPU with compiled FlexAttention inside each layer's graph: outputs and
gradients in fp32 and under bf16 autocast, and no graph break."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config

from trainer.model.drafter import Drafter, shape_from_target
from trainer.settings.config import ModelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

H, V, S, N, B = 256, 1000, 512, 16, 16


def drafter() -> Drafter:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        pad_token_id=0,
    )
    model = ModelConfig(
        target="t", num_layers=2, block_size=B, sliding_window=128, sliding_layers=[1]
    )
    return Drafter(shape_from_target(config, model, num_features=3)).cuda().train()


def batch():
    g = torch.Generator().manual_seed(1)
    features = torch.randn(2, S, 3 * H, generator=g)
    ids = torch.randint(1, V, (2, S), generator=g)
    anchors = torch.sort(torch.randint(1, S - B, (2, N), generator=g), dim=1).values
    valid = torch.ones(2, N, dtype=torch.bool)
    valid[1, -1] = False
    embed = torch.randn(V, H, generator=g)
    return [t.cuda() for t in (features, ids, anchors, valid, embed)]


def grads(model: Drafter, inputs, autocast: bool):
    features, ids, anchors, valid, embed = inputs
    features = features.clone().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = model(features, ids, anchors, valid, embed)
    weights = torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out)
    (out.float() * weights).sum().backward()
    return [out.detach().float(), features.grad] + [p.grad for p in model.parameters()]


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


@pytest.mark.parametrize("autocast,bound", [(False, 1e-4), (True, 3e-2)])
def test_compiled_layers_match_eager_on_gpu(autocast: bool, bound: float) -> None:
    from torch._dynamo.utils import counters

    inputs = batch()
    eager = grads(drafter(), inputs, autocast)
    model = drafter()
    counters.clear()
    model.compile_layers()
    compiled = grads(model, inputs, autocast)
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    errors = [rel(c, e) for c, e in zip(compiled, eager, strict=True)]
    assert max(errors) < bound, errors
