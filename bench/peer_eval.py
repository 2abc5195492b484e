"""Held-out τ of both trained drafters, read from their exported folders, in two ways:

- `evaluate`: this project's evaluator (`trainer.evaluation.report.evaluate`, as `bench_eval.py`
  measures its drafters: the fp32 target, greedy, the lossless check against the target's own
  greedy output), each folder loaded by `trainer.export.hf_format.load_folder` (SpecForge's exported
  folder loads into ours as it is); prompt lookup beside them on the same prompts; paired
  95 % intervals over the same prompts (`trainer.evaluation.tau_bootstrap`);
- `reference`: the DFlash authors' decoding loop (`dflash_generate` of z-lab/dflash's
  `dflash/model.py`, with its own `DFlashDraftModel` loaded from each folder and the target as
  a plain `transformers` model): an independent implementation of drafting and verifying,
  carried as the public file (never part of this repository) and imported from its path. Two
  adaptations, neither touching its logic: on the CPU its timer (which synchronises CUDA) is
  `time.perf_counter`; under transformers ≥ 5.18, where `DynamicCache.crop` no longer takes
  the length to keep, its cache is a `DynamicCache` whose `crop(n > 0)` keeps n (what 5.17
  does with it). Prompts are decoded one at a time, both drafters on each prompt before the
  next, until `reference_seconds`: the pairs stay complete when the time runs out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from bench.common import log
from bench.peer_common import Settings, ours_folder, specforge_folder, write_stage
from bench.peer_recipe import target_layers

DRAFTERS = ("ours", "specforge")


def folders(settings: Settings) -> dict[str, Path]:
    """The exported folders that exist, by trainer."""
    found = {"ours": ours_folder(settings), "specforge": specforge_folder(settings)}
    return {name: path for name, path in found.items() if (path / "config.json").is_file()}


def held_out_prompts(settings: Settings) -> list[list[int]]:
    """The first `eval_prompts` windows of the held-out files (`bench_eval`'s prompts.jsonl)."""
    lines = (settings.root / "prompts.jsonl").read_text().splitlines()
    return [json.loads(line)["input_ids"] for line in lines[: settings.eval_prompts]]


def paired(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """τ_a − τ_b with its paired 95 % interval over the same prompts."""
    from trainer.evaluation.tau_bootstrap import tau_difference

    if not a or not b or len(a["prompt_counts"]) != len(b["prompt_counts"]):
        return None
    diff, lo, hi = tau_difference(a["prompt_counts"], b["prompt_counts"])
    return {"value": diff, "interval": [lo, hi], "prompts": len(a["prompt_counts"])}


# ---- this project's evaluator ---------------------------------------------------------------------


def evaluate(settings: Settings) -> dict[str, Any]:
    from bench.bench_eval import lookup_baseline, measure, trained_block
    from trainer.evaluation.speculative import greedy_outputs
    from trainer.export.hf_format import load_folder, read_config
    from trainer.model.target import load_target

    device = torch.device(settings.device)
    target = load_target(settings.root / "target", layers=target_layers(settings))
    target.model.to(device)  # type: ignore[arg-type]  # fp32, as bench_eval measures
    prompts = held_out_prompts(settings)
    expected = greedy_outputs(target, prompts, settings.max_new_tokens)
    expected_path(settings).write_text(json.dumps(expected) + "\n")  # the reference loop's check
    options = argparse.Namespace(
        block_size=settings.block_size, lookup_max_n=settings.lookup_max_n,
        max_new_tokens=settings.max_new_tokens,
    )  # fmt: skip
    lookup = lookup_baseline(target, prompts, options, expected)
    rows: dict[str, Any] = {}
    result = evaluation(len(prompts), lookup, rows)
    write_stage(settings, "evaluate", result)  # what is done so far stays if the stage is stopped
    for name, folder in folders(settings).items():
        layers = list(read_config(folder)["dflash_config"]["target_layer_ids"])
        if layers != target.layers:
            raise SystemExit(f"{folder} reads target layers {layers}, the target {target.layers}")
        drafter, _ = load_folder(folder, device=device)
        log(f"{name}, held out ({folder}):")
        block = trained_block(target, drafter)
        rows[name] = measure(target, block, prompts, settings.max_new_tokens, expected=expected)
        result = evaluation(len(prompts), lookup, rows)
        write_stage(settings, "evaluate", result)
    return result


def expected_path(settings: Settings) -> Path:
    """The target's own greedy outputs of the held-out prompts (kept apart from the figures)."""
    return settings.root / "greedy-outputs.json"


def evaluation(prompts: int, lookup: dict[str, Any], rows: dict[str, Any]) -> dict[str, Any]:
    return {
        "prompts": prompts,
        "prompt_lookup": lookup,
        "drafters": rows,
        "ours_minus_specforge": paired(rows.get("ours"), rows.get("specforge")),
        "ours_minus_lookup": paired(rows.get("ours"), lookup),
        "specforge_minus_lookup": paired(rows.get("specforge"), lookup),
    }


# ---- the DFlash authors' decoding loop -----------------------------------------------------------


def load_reference(path: str | Path, device: torch.device) -> ModuleType:
    """z-lab/dflash's `dflash/model.py`, imported from its file (the adaptations: module doc)."""
    spec = importlib.util.spec_from_file_location("zlab_dflash_reference", str(path))
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if device.type != "cuda":
        module._cuda_time = time.perf_counter  # type: ignore[attr-defined]
    if not _crop_keeps_length():
        module.DynamicCache = _keep_length_cache()  # type: ignore[attr-defined]
    return module


def _crop_keeps_length() -> bool:
    """Whether this transformers' `DynamicCache.crop(n > 0)` still keeps n tokens (≤ 5.17)."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release < (5, 18)


def _keep_length_cache() -> type:
    from transformers import DynamicCache

    class KeepLength(DynamicCache):
        """`crop(n > 0)`: keep the first n tokens, as transformers 5.17 reads it."""

        def crop(self, n: int) -> None:
            if n > 0:
                n -= self.get_seq_length()
                if n >= 0:
                    return
            super().crop(n)

    return KeepLength


def reference(settings: Settings) -> dict[str, Any]:
    """Both drafters on each prompt in turn until `reference_seconds`; the result so far is
    written after every prompt (a stage stopped midway keeps complete pairs)."""
    from transformers import AutoModelForCausalLM

    device = torch.device(settings.device)
    if not settings.reference or not Path(settings.reference).is_file():
        return {"ok": False, "why": f"z-lab's dflash/model.py not found ({settings.reference})"}
    module = load_reference(settings.reference, device)
    folder = str(settings.root / "target")
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True)
    hf = hf.to(device).eval()  # type: ignore[arg-type]
    drafts = {
        name: module.DFlashDraftModel.from_pretrained(str(path), dtype=torch.float32)
        .to(device)
        .eval()
        for name, path in folders(settings).items()
    }
    eos = hf.config.eos_token_id
    stop = [eos] if isinstance(eos, int) else list(eos or [])
    found = expected_path(settings)
    expected = json.loads(found.read_text()) if found.is_file() else None
    prompts = held_out_prompts(settings)[: settings.reference_prompts]
    counts: dict[str, list[tuple[int, int]]] = {name: [] for name in drafts}
    same = dict.fromkeys(drafts, 0)
    deadline = time.perf_counter() + settings.reference_seconds
    for i, prompt in enumerate(prompts):
        if time.perf_counter() > deadline:
            break
        ids = torch.tensor([prompt], device=device)
        for name, draft in drafts.items():
            out = module.dflash_generate(
                draft, hf, ids, settings.max_new_tokens, stop, 0.0, return_stats=True
            )
            lengths = list(out.acceptance_lengths)
            counts[name].append((sum(lengths), len(lengths)))
            if expected is not None:
                same[name] += out.output_ids[0, len(prompt) :].tolist() == expected[i]
        write_stage(settings, "reference", reference_result(settings, counts, same, expected))
    log(f"reference loop: {len(next(iter(counts.values()), []))} of {len(prompts)} prompts")
    return reference_result(settings, counts, same, expected)


def reference_result(
    settings: Settings,
    counts: dict[str, list[tuple[int, int]]],
    same: dict[str, int],
    expected: list[list[int]] | None,
) -> dict[str, Any]:
    """τ of each drafter over the prompts decoded so far, and their paired difference."""
    from trainer.evaluation.tau_bootstrap import tau_interval

    done = len(next(iter(counts.values()), []))
    rows = {
        name: {
            "tau": sum(t for t, _ in c) / max(1, sum(p for _, p in c)),
            "tau_interval": tau_interval(c) if c else None,
            "prompt_counts": c,
            "identical_to_greedy": same[name] if expected is not None else None,
        }
        for name, c in counts.items()
    }
    return {
        "ok": done > 0,
        "prompts": done,
        "drafters": rows,
        "ours_minus_specforge": paired(rows.get("ours"), rows.get("specforge")),
        "file": settings.reference,
    }


def stage(settings: Settings, name: str) -> None:
    result = evaluate(settings) if name == "evaluate" else reference(settings)
    write_stage(settings, name, result)
