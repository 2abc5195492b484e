"""The target's linear-attention layers (Gated DeltaNet, the `qwen3_5` family): which code
`transformers` runs them with, said by `trainer.commands.check` before a job starts and in its log.

`transformers` (5.x) binds each operation of those layers once, when its modeling module is
imported (`integrations.hub_kernels.use_kernel_func_from_hub_with_fallback`):
- the chunked gated delta rule to `fla.ops.gated_delta_rule.chunk_gated_delta_rule` (Triton)
  when `fla` imports — the `fla-core` package, `pip install 'dflash[kernels]'` — else to its
  pure-PyTorch reference, a Python loop over 64-token chunks of every layer;
- the short causal convolution to `causal_conv1d.causal_conv1d_fn` (CUDA) when the
  `causal-conv1d` package imports — a source distribution that compiles against the CUDA
  toolkit and torch at install time, so not part of the extra — else to `F.conv1d`.
Later `transformers` versions run the reference for inputs on a device the kernels do not
support (the CPU). Nothing here chooses an implementation: `bound_ops` reads the one the
wrapper captured, so what the log names is what the forward runs (the `kernels` hub library's
replacements apply only to a model `kernelize`d with `use_kernels=True`, which the trainer
never asks for). What the fallback costs at
the seed's size is measured by `bench/seed_size.py` (docs/benchmarks.md, "The seed's target at
its own size").

`torch.compile` of the target's forward unrolls the reference's Python loop (one step per 64
tokens, per layer): `run.compile_target` left unset therefore keeps such a target eager
(`trainer.settings.config.RunConfig.compiles_target_on`).
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, cast

LINEAR = "linear_attention"
DOC = 'docs/benchmarks.md, "The seed\'s target at its own size"'

# the modeling module's name of each operation: what it does, what runs it without a kernel
# and what that means on a GPU (what it costs at the seed's size: DOC)
_OPS = {
    "torch_chunk_gated_delta_rule": (
        "gated delta rule",
        "PyTorch reference",
        "a Python loop over 64-token chunks of every layer, much slower than fla's Triton "
        "kernels: pip install 'dflash[kernels]'",
    ),
    "causal_conv1d_fn": (
        "causal conv1d",
        "PyTorch F.conv1d",
        "the causal-conv1d package replaces it where it is built against the job's CUDA torch",
    ),
}


@dataclass(frozen=True)
class OpPath:
    """One operation of the linear-attention layers and the code that runs it."""

    op: str  # "gated delta rule"
    kernel: str | None  # the package whose function runs, with its version; None: the fallback
    fallback: str  # what runs without the kernel
    advice: str  # what the fallback means on a GPU, and what brings the kernel

    def describe(self) -> str:
        return f"{self.op}: {self.kernel or self.fallback}"


def _layer_types(config: Any) -> list[str]:
    """`layer_types` of the language model's config: a `transformers` config (multimodal ones
    keep it under `text_config`), an attribute namespace or a `config.json` dict."""
    if isinstance(config, Mapping):
        text = config.get("text_config")
        config = text if "layer_types" not in config and isinstance(text, Mapping) else config
        return list(config.get("layer_types") or [])
    get = getattr(config, "get_text_config", None)
    config = get(decoder=True) if callable(get) else config
    return list(getattr(config, "layer_types", None) or [])


def linear_layers(config: Any) -> tuple[int, int]:
    """(linear-attention layers, all layers) of a target config; (0, n) for a dense target."""
    types = _layer_types(config)
    return sum(t == LINEAR for t in types), len(types)


def has_linear_attention(config: Any) -> bool:
    return linear_layers(config)[0] > 0


def modeling_module(model_type: str) -> Any:
    """`transformers`' modeling module of a family (`qwen3_5_text` is `qwen3_5`'s)."""
    family = model_type.removesuffix("_text")
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def _captured(fn: Any, name: str) -> Any:
    """The variable `name` that the function `fn` (or its class's `forward`) closes over."""
    code = fn if inspect.isfunction(fn) else getattr(type(fn), "forward", None)
    if not inspect.isfunction(code):
        return None
    return inspect.getclosurevars(code).nonlocals.get(name)


def transformers_wrapper(fn: Any) -> Callable[..., Any] | None:
    """`transformers`' kernel wrapper behind `fn`: `fn` itself, or the function that the
    `kernels` hub library's module wrapper (installed with newer `transformers`) calls; None
    where there is none."""
    for _ in range(3):
        if callable(_captured(fn, "implementation")):
            return cast(Callable[..., Any], fn)
        fn = _captured(fn, "func")
        if not callable(fn):
            return None
    return None


def kernel_of(fn: Any) -> str | None:
    """The package (and version) whose function `transformers`' wrapper `fn` calls; None where
    it calls its own reference (the function it wraps)."""
    wrapper = transformers_wrapper(fn)
    if wrapper is None:
        return None
    impl = _captured(wrapper, "implementation")
    if impl is getattr(wrapper, "__wrapped__", None):
        return None
    package = (getattr(impl, "__module__", None) or "?").split(".")[0]
    version = getattr(sys.modules.get(package), "__version__", None)
    return f"{package} {version}" if version else package


def bound_ops(model_type: str, *, device_type: str = "cuda") -> list[OpPath]:
    """What runs each operation of the family's linear-attention layers on `device_type`
    (imports `transformers`' modeling module, as loading the target does). The kernels run on
    CUDA only: on another device the reference runs."""
    module = modeling_module(model_type)
    paths = []
    for name, (op, fallback, advice) in _OPS.items():
        fn = getattr(module, name, None)
        kernel = kernel_of(fn) if fn is not None and device_type == "cuda" else None
        paths.append(OpPath(op=op, kernel=kernel, fallback=fallback, advice=advice))
    return paths


def describe(config: Any, *, device_type: str = "cuda") -> str | None:
    """The log's and the check's line on the target's linear-attention layers (None for a
    dense target): how many, what runs each operation, and what a fallback means."""
    linear, total = linear_layers(config)
    if not linear:
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    model_type = text["model_type"] if isinstance(text, Mapping) else text.model_type
    paths = bound_ops(str(model_type), device_type=device_type)
    line = f"linear attention (Gated DeltaNet) in {linear} of {total} target layers: " + "; ".join(
        p.describe() for p in paths
    )
    missing = [p for p in paths if p.kernel is None]
    if not missing:
        return line
    if device_type != "cuda":
        return f"{line} (the kernels run on CUDA only)"
    advice = "; ".join(f"{p.op}: {p.advice}" for p in missing)
    return f"{line}. Fallback — {advice} (what it costs: {DOC})"
