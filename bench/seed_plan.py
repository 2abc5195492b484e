"""`bench/seed_size.py`'s summary: the figures of its stages in one place, and the node plan
they give (`trainer.commands.plan`, the arithmetic `dflash plan` prints) with the memory of a rank of
each role, beside the seed's own measured rates.

The plan's rates: r_target from the target's feature forward with the kernels at the longest
length measured (the fallback's where the kernels' stage has none), r_drafter from the drafter
step on the default attention kernels (the CuTe-DSL ones where only they ran). Memory of a
target rank: its peak over the forward at that length plus the batches it may hold for the
drafters (`split.max_in_flight`, each the selected layers and the last hidden state); of a
drafter rank: the drafter step's peak. The plan of 8 GPUs once more with the drafter step of
`run.recompute_layers` (its rate and its peak), where that stage ran.
"""

from __future__ import annotations

from typing import Any

from trainer.commands.plan import Rates, format_report, predict, report

SEED_RATES = {"6+2": 13_500.0, "5+3": 21_500.0}  # the seed's tokens/s on 8 GPUs, 6 + 2 and 5 + 3
NODES = (8, 4, 2)


def measured_row(stage: dict[str, Any] | None) -> dict[str, Any] | None:
    """The timed row of a target stage at its longest measured length."""
    rows = [r for r in (stage or {}).get("rows", []) if "tokens_per_s" in r]
    return max(rows, key=lambda r: r["tokens"]) if rows else None


def _drafter(stage: dict[str, Any] | None) -> dict[str, Any]:
    if stage is None:
        return {}
    if "unavailable" in stage:
        return {"unavailable": stage["unavailable"]}
    return {
        **stage.get("result", {}),
        "steps_s": stage.get("step_s"),
        "shape": stage.get("drafter"),
    }


def summary_fields(
    stages: dict[str, dict[str, Any] | None], runs: dict[str, Any], *, max_in_flight: int
) -> dict[str, Any]:
    """The figures the record keeps (`target.tokens_per_s`, `target.mfu`, … `gpu`, `torch`)."""
    env = next((s["env"] for s in stages.values() if s and "env" in s), {})
    target, fallback = stages.get("target") or {}, stages.get("target-fallback") or {}
    row, slow = measured_row(target), measured_row(fallback)
    auto, flash = _drafter(stages.get("drafter")), _drafter(stages.get("drafter-flash"))
    same = next(
        (r for r in target.get("rows", []) if slow and r.get("tokens") == slow["tokens"]), None
    )
    return {
        "gpu": env.get("gpu"),
        "torch": env.get("torch"),
        "environment": env,
        "target": {
            "tokens": row and row["tokens"],
            "tokens_per_s": row and row["tokens_per_s"],
            "mfu": row and row["mfu"],
            "peak_gib": row and row.get("peak_gib"),
            "features_gib": row and row.get("features_gib"),
            "linear_attention": target.get("linear_attention"),
            "fallback_tokens": slow and slow["tokens"],
            "fallback_tokens_per_s": slow and slow["tokens_per_s"],
            "fallback_mfu": slow and slow["mfu"],
            "kernels_over_fallback": (
                same["tokens_per_s"] / slow["tokens_per_s"] if same and slow else None
            ),
            "rows": target.get("rows"),
            "fallback_rows": fallback.get("rows"),
            "compiled_rows": (stages.get("target-compiled") or {}).get("rows"),
            "conv": target.get("conv"),
            "build_s": target.get("build_s"),
        },
        "drafter": {
            "mfu": auto.get("mfu"),
            "peak_gib": auto.get("peak_gib"),
            "step_s": auto.get("step_s"),
            "tokens_per_s": auto.get("tokens_per_s"),
            "default_kernels": auto,
            "recompute": _drafter(stages.get("drafter-recompute")),
            "flash_kernels": flash,
        },
        "split": stages.get("split"),
        "stages": runs,
        "max_in_flight": max_in_flight,
    }


def rates_of(summary: dict[str, Any], drafter: dict[str, Any] | None = None) -> Rates | None:
    """The plan's rates from the summary's figures (the drafter's from `drafter`, a step's
    figures, when given); None until both roles have one."""
    t, d = summary["target"], summary["drafter"]
    r_target = t["tokens_per_s"] or t["fallback_tokens_per_s"]
    tokens = t["tokens"] or t["fallback_tokens"]
    if drafter is None:
        drafter = d["default_kernels"] if d["tokens_per_s"] else d["flash_kernels"]
    r_drafter = drafter.get("tokens_per_s")
    if not r_target or not r_drafter:
        return None
    return Rates(
        r_target=r_target,
        r_drafter=r_drafter,
        tokens_per_batch=float(tokens),
        target_s_per_batch=tokens / r_target,
        drafter_s_per_batch=drafter["tokens"] / r_drafter,
        target_device=f"{summary['gpu']}, {_paths(t)}",
        drafter_device=f"{summary['gpu']} ({'default' if d['tokens_per_s'] else 'flash'})",
        **rank_memory(summary) | {"drafter_peak_gib": drafter.get("peak_gib")},
    )


def _paths(target: dict[str, Any]) -> str:
    """How the rate's target ran its linear-attention layers."""
    if not target["tokens_per_s"]:
        return "PyTorch reference"
    return ", ".join(f"{op}: {how}" for op, how in (target["linear_attention"] or {}).items())


def rank_memory(summary: dict[str, Any]) -> dict[str, float | None]:
    t, d = summary["target"], summary["drafter"]
    target = None
    if t["peak_gib"] is not None and t["features_gib"] is not None:
        target = t["peak_gib"] + summary["max_in_flight"] * t["features_gib"]
    return {"target_peak_gib": target, "drafter_peak_gib": d["peak_gib"]}


def plan_summary(summary: dict[str, Any]) -> dict[str, Any]:
    """Every split of 8, 4 and 2 GPUs at the measured rates, the best of 8, memory per rank."""
    rates = rates_of(summary)
    out: dict[str, Any] = {"seed_tokens_per_s": SEED_RATES, "memory": rank_memory(summary)}
    if rates is None:
        return {**out, "best_split": None, "best_tokens_per_s": None, "missing": "a rate"}
    reports = {}
    for gpus in NODES:
        r = report(rates, gpus)
        reports[gpus] = {**r, "text": format_report(r)}
    best = reports[8]["best"]
    seed = {s: next(x["tokens_per_s"] for x in reports[8]["splits"] if _name(x) == s)
            for s in SEED_RATES}  # fmt: skip
    return {
        **out,
        "best_split": _name(best),
        "best_tokens_per_s": best["tokens_per_s"],
        "predicted_at_seed_splits": seed,
        "with_recompute": _recompute_plan(summary),
        "reports": reports,
    }


def _recompute_plan(summary: dict[str, Any]) -> dict[str, Any] | None:
    """The best split of 8 GPUs with the drafter step of `run.recompute_layers`."""
    step = summary["drafter"]["recompute"]
    rates = rates_of(summary, step) if step.get("tokens_per_s") else None
    if rates is None:
        return None
    best = max(predict(rates, 8), key=lambda s: s.tokens_per_s)
    return {
        "best_split": f"{best.targets}+{best.drafters}",
        "best_tokens_per_s": best.tokens_per_s,
        "drafter_peak_gib": step.get("peak_gib"),
    }


def _name(split: dict[str, Any]) -> str:
    return f"{split['targets']}+{split['drafters']}"


def plan_for_gpus(stages: dict[str, dict[str, Any] | None], gpus: int) -> tuple[int, float | None]:
    """(target ranks, predicted tokens/s) of the best split of `gpus` at the measured rates;
    half the GPUs for the target (`trainer.split.split_rule`) while a rate is missing."""
    from trainer.split.split_rule import default_target_gpus

    rates = rates_of(summary_fields(stages, {}, max_in_flight=0))
    if rates is None:
        return default_target_gpus(gpus), None
    best = max(predict(rates, gpus), key=lambda s: s.tokens_per_s)
    return best.targets, best.tokens_per_s
