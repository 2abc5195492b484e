"""`trainer.model.linear_attention`: what `transformers` bound for a hybrid target's linear-attention
layers, read from its own kernel wrapper, and the optional `kernels` extra that brings the fast
path without which everything still installs and runs (the reference)."""

from __future__ import annotations

import importlib.util
import json
import tomllib
from pathlib import Path

import pytest

from tests.trainer.hybrid_target import hybrid_model
from trainer.model.linear_attention import describe, has_linear_attention, kernel_of, linear_layers

ROOT = Path(__file__).resolve().parents[2]


def test_the_package_a_transformers_wrapper_calls_is_read_from_the_wrapper() -> None:
    """transformers' own decorator, bound to a package that imports (json, with a version) and
    to one that does not: the first calls the package's function, the second its reference."""
    from transformers.integrations.hub_kernels import use_kernel_func_from_hub_with_fallback

    def dumps(obj, **kwargs):  # the reference the wrapper falls back to
        return "reference"

    bound = use_kernel_func_from_hub_with_fallback("dumps", "json")(dumps)
    assert kernel_of(bound) == f"json {json.__version__}"
    assert bound({"a": 1}) == '{"a": 1}'
    absent = use_kernel_func_from_hub_with_fallback("dumps", "dflash_no_such_package")(dumps)
    assert kernel_of(absent) is None and absent({}) == "reference"
    assert kernel_of(dumps) is None and kernel_of(len) is None


def test_a_hybrid_target_names_its_fallback_and_a_dense_one_says_nothing() -> None:
    assert importlib.util.find_spec("fla") is None, "these tests run without the kernels extra"
    config = hybrid_model().config
    assert linear_layers(config) == (2, 4) and has_linear_attention(config)
    on_cuda = describe(config, device_type="cuda")
    assert on_cuda is not None
    assert on_cuda.startswith(
        "linear attention (Gated DeltaNet) in 2 of 4 target layers: gated delta rule: PyTorch "
        "reference; causal conv1d: PyTorch F.conv1d. Fallback — gated delta rule: a Python "
        "loop over 64-token chunks of every layer, much slower than fla's Triton kernels: pip "
        "install 'dflash[kernels]'; causal conv1d: the causal-conv1d package replaces it"
    )
    assert on_cuda.endswith(
        '(what it costs: docs/benchmarks.md, "The seed\'s target at its own size")'
    )
    on_cpu = describe(config, device_type="cpu")
    assert on_cpu is not None and on_cpu.endswith("(the kernels run on CUDA only)")
    # the same from config.json as read by the check (the text model nested in a multimodal one)
    raw = {"model_type": "qwen3_5", "text_config": config.to_dict()}
    assert describe(raw, device_type="cpu") == on_cpu
    from transformers import Qwen3Config

    assert describe(Qwen3Config(num_hidden_layers=2), device_type="cuda") is None
    assert not has_linear_attention({"layer_types": ["full_attention"] * 2})


def test_the_kernels_extra_is_optional_and_pulls_no_torch() -> None:
    """`pip install dflash` installs none of it; `dflash[kernels]` adds fla-core alone, whose
    own requirements name torch only in its `cuda` extra (no CUDA torch pulled by surprise)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = " ".join(project["dependencies"]).lower()
    assert not any(name in base for name in ("fla", "causal-conv1d", "triton"))
    assert project["optional-dependencies"]["kernels"] == ["fla-core>=0.5.0"]


@pytest.mark.parametrize(
    "module", ["trainer.model.linear_attention", "trainer.commands.check", "trainer.commands.train"]
)
def test_the_trainer_imports_without_the_kernels(module: str) -> None:
    importlib.import_module(module)
