"""A hybrid target's linear-attention layers on the kernels `pip install 'dflash[kernels]'`
brings (fla's Triton gated delta rule, where it imports): transformers binds them, the line the
check and the log print names them, their output equals transformers' own pure-PyTorch
reference computed in float32 within bf16 rounding, and a hybrid target runs eager on them
through the worker a run uses."""

from __future__ import annotations

import pytest
import torch

from tests.trainer.hybrid_target import hybrid_model

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _kernels() -> None:
    pytest.importorskip("fla.ops.gated_delta_rule", reason="the kernels extra is not installed")


def test_the_bound_kernel_matches_transformers_reference() -> None:
    from trainer.model.linear_attention import bound_ops, modeling_module, transformers_wrapper

    paths = {p.op: p.kernel for p in bound_ops("qwen3_5_text")}
    assert (paths["gated delta rule"] or "").startswith("fla ")
    bound = modeling_module("qwen3_5_text").torch_chunk_gated_delta_rule
    wrapper = transformers_wrapper(bound)
    assert wrapper is not None
    reference = wrapper.__wrapped__  # the function transformers falls back to
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, tokens, heads, dim = 2, 1000, 6, 128  # 1,000: not a whole number of 64-token chunks

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=gen)

    q, k, v = (randn(rows, tokens, heads, dim).bfloat16() for _ in range(3))
    decay = -torch.nn.functional.softplus(randn(rows, tokens, heads))  # log space, ≤ 0
    beta = randn(rows, tokens, heads).sigmoid().bfloat16()
    with torch.no_grad():
        got, _ = bound(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
        want, _ = reference(q.float(), k.float(), v.float(), g=decay, beta=beta.float(),
                            use_qk_l2norm_in_kernel=True)  # fmt: skip
    error = (got.float() - want).norm() / want.norm()
    assert got.shape == want.shape and error < 2e-2, float(error)


def test_a_hybrid_target_runs_eager_on_the_kernels_and_says_so() -> None:
    from trainer.model.linear_attention import describe
    from trainer.model.target import Target
    from trainer.run.target_worker import TargetWorker
    from trainer.settings.loading import config_from_dict

    model = hybrid_model().to("cuda", torch.bfloat16)
    model.requires_grad_(False)
    target = Target(model, [0, 1])
    worker = TargetWorker.for_run(target, config_from_dict({"model": {"target": "t"},
                                                            "data": {"path": "d"}}))  # fmt: skip
    assert not worker.compiled  # run.compile_target unset: eager for linear-attention layers
    with torch.no_grad():
        out = target(torch.randint(1, 300, (2, 200), device="cuda"))
    assert out.features.shape == (2, 200, 128) and torch.isfinite(out.features).all()
    line = describe(model.config, device_type="cuda")
    assert line is not None and "gated delta rule: fla " in line
