"""Serve prompts with vLLM's offline API and write its engine report (`trainer.evaluation.engine_report`):
what `python -m trainer evaluate --engine-report FILE` then holds against the project.

    python -m trainer vllm-report --target /models/target --drafter ./drafter \\
        --prompts prompts.jsonl --max-tokens 64 --out vllm.jsonl [--no-drafter] [--dtype float32]

Runs where vLLM is installed (its own environment: vLLM pins its torch), from the release or a
checkout of this project (`trainer/` on the path). `--prompts` is a JSONL of the training formats
(`trainer.data.eval_prompts`: a tokenized line gives its unsupervised prefix); vLLM gets token ids,
never text. The drafter is served as `docs/serving.md` says: `{"method": "dflash", "model":
DRAFTER, "num_speculative_tokens": B − 1}` with B the folder's `block_size`
(`--num-speculative-tokens` to serve another K: another drafter, see docs/serving.md). Greedy
(temperature 0), every request to its full budget (`ignore_eos`), prefix caching off (each
request drafts from its own prefill), and vLLM's per-request acceptance
(`per_request_spec_decode_metrics="detailed"`: accepted drafts per verify step).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.base.errors import TrainerError
from trainer.evaluation.engine_report import EngineRequest, write_report
from trainer.export.serving import num_speculative_tokens


def speculative_config(drafter: str | Path, k: int) -> dict[str, Any]:
    """vLLM's `speculative_config` for an exported folder drafting `k` tokens per step."""
    return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": k}


def engine_args(
    target: str | Path,
    drafter: str | Path | None,
    k: int | None,
    *,
    dtype: str = "float32",
    max_model_len: int = 2048,
) -> dict[str, Any]:
    """The keyword arguments of `vllm.LLM`: greedy-ready, eager, no prefix caching, and with a
    drafter its per-request acceptance (`per_request_spec_decode_metrics="detailed"`)."""
    kwargs: dict[str, Any] = {
        "model": str(target),
        "dtype": dtype,
        "seed": 0,
        "max_model_len": max_model_len,
        "enable_prefix_caching": False,
        "enforce_eager": True,
    }
    if drafter is not None:
        assert k is not None
        kwargs["speculative_config"] = speculative_config(drafter, k)
        kwargs["per_request_spec_decode_metrics"] = "detailed"
    return kwargs


def _vllm() -> Any:
    """vLLM, which this tool needs and the training job does not (a probe: the job's python is
    not asked for it, `dflash_ops.remote.requirements`)."""
    try:
        import vllm
    except ImportError as exc:
        raise TrainerError(
            f"vLLM does not import in this python ({exc})",
            hint="Run this tool in vLLM's own environment (make serve-test builds one in "
            ".venv-serve; vLLM pins its own torch).",
        ) from None
    return vllm


def serve(
    llm: Any, prompts: Sequence[Sequence[int]], max_tokens: int, k: int | None
) -> list[EngineRequest]:
    """Every prompt through `llm.generate` (greedy, to the budget) → the report's requests."""
    params = _vllm().SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
    requests = []
    for prompt, out in zip(prompts, outputs, strict=True):
        done = out.outputs[0]
        accepted = None
        if k is not None:
            metrics = done.spec_decode_metrics
            if metrics is None:
                raise TrainerError(
                    "vLLM returned no per-request acceptance",
                    hint="Use a vLLM with per_request_spec_decode_metrics (0.32 or later).",
                )
            accepted = list(metrics.per_step_accepted)
        requests.append(EngineRequest(list(prompt), list(done.token_ids), max_tokens, accepted, k))
    return requests


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainer vllm-report", description=__doc__.split("\n")[0]
    )
    p.add_argument("--target", required=True, help="the target model's folder (or hub name)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--drafter", help="the exported drafter folder")
    which.add_argument("--no-drafter", action="store_true", help="serve the target alone")
    p.add_argument("--prompts", required=True, help="JSONL: tokenized samples or chat messages")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument("--limit", type=int, default=None, help="the first N prompts only")
    p.add_argument("--num-speculative-tokens", type=int, default=None, help="K (default: B − 1)")
    p.add_argument("--dtype", default="float32", help="vLLM's dtype for the target and drafter")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--out", required=True, help="the engine report to write (JSONL)")
    args = p.parse_args(argv)
    if args.max_tokens < 1:
        p.error("--max-tokens must be ≥ 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from trainer.data.eval_prompts import load_prompts

        prompts = load_prompts(args.prompts, tokenizer_dir=args.target, limit=args.limit)
        args.k = None
        if args.drafter:
            args.k = args.num_speculative_tokens or num_speculative_tokens(args.drafter)
        kwargs = engine_args(
            args.target, args.drafter, args.k, dtype=args.dtype, max_model_len=args.max_model_len
        )
        llm = _vllm().LLM(**kwargs)
        requests = serve(llm, prompts, args.max_tokens, args.k)
    except TrainerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    write_report(args.out, requests)
    print(
        json.dumps({"out": args.out, "requests": len(requests), "num_speculative_tokens": args.k})
    )
    return 0
