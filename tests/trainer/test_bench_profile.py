"""bench/profile_drafter.py: kernels sorted into kinds, and a real (tiny, CPU) profiled run."""

from __future__ import annotations

import json

import pytest

from bench.profile_drafter import kind_of, main, summarize


@pytest.mark.parametrize(
    "name,kind",
    [
        ("triton_tem_fused_flex_attention_backward_0", "attention backward"),
        ("triton_tem_fused_flex_attention_0", "attention forward"),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention forward"),
        ("triton_poi_fused_create_block_mask_3", "block mask"),
        ("_stats_kernel", "loss kernels"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_NTT", "matmul"),
        ("aten::addmm", "matmul"),
        (
            "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>",
            "optimizer",
        ),
        ("ncclDevKernel_SendRecv", "communication"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "other"),
    ],
)
def test_kernel_kinds(name: str, kind: str) -> None:
    assert kind_of(name) == kind


def test_summary_shares_add_up_per_kind() -> None:
    rows = summarize([("nvjet_a", 600.0), ("nvjet_b", 200.0), ("_grad_kernel", 100.0)], 1000.0)
    assert rows == [
        {"kind": "matmul", "ms_per_step": 0.8, "share": 0.8},
        {"kind": "loss kernels", "ms_per_step": 0.1, "share": 0.1},
    ]


def test_smoke_run_writes_its_summary(tmp_path, capsys) -> None:
    out = tmp_path / "profile.json"
    argv = ["--smoke", "--steps", "1", "--warmup", "1", "--attention-kernels", "small"]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["step_ms"] > 0
    assert result["attention_kernels"] == "small"
    assert result["compiled_layers"] is False and result["model_flops_per_step"] > 0
    kinds = {r["kind"] for r in result["kinds"]}
    assert {"matmul", "attention forward", "optimizer"} <= kinds
    assert sum(r["share"] for r in result["kinds"]) == pytest.approx(1.0)
    assert "| kind | ms per step | share of kernel time |" in capsys.readouterr().out


def test_smoke_run_in_parts_counts_the_whole_batch(tmp_path) -> None:
    """Two sequences a step in two parts: the model FLOPs and tokens of both sequences."""
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    base = ["--smoke", "--steps", "1", "--warmup", "1"]
    assert main([*base, "--out", str(one)]) == 0
    assert main([*base, "--batch-size", "2", "--micro-batches", "2", "--out", str(two)]) == 0
    single, double = (json.loads(p.read_text()) for p in (one, two))
    assert (double["batch_size"], double["micro_batches"]) == (2, 2)
    assert double["model_flops_per_step"] == pytest.approx(
        2 * single["model_flops_per_step"], rel=0.25
    )  # the same shapes, other random tokens
    assert double["tokens_per_s"] == pytest.approx(2 * 128 / (double["step_ms"] / 1e3))
