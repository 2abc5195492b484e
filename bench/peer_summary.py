"""`summary.json` and `summary.md` of `bench/compare_peer.py`, from the stages' results so far
(a stage that did not finish leaves its figures null, and says why under `stages`)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from bench.peer_common import Settings, data_figures, rates, read_stage, write_stage


def differences(settings: Settings) -> list[dict[str, str]]:
    """Every setting the two trainers do not share in this comparison, and why."""
    gpu = settings.device == "cuda"
    return [
        {
            "setting": "target features",
            "ours": "computed each step by the target in the same process (its forward compiled "
            "on the GPU): the colocated run",
            "specforge": "read from disk: offline feature files captured once from the same "
            "target (specforge-capture, timed apart)",
            "why": "SpecForge 0.2.0 trains online only against an SGLang server; without one "
            "its training entry reads offline features",
        },
        {
            "setting": "loss",
            "ours": f"CE + {settings.kl_weight}·KL toward the target (loss.kl_weight, its default)",
            "specforge": "CE only",
            "why": f"its DFlash loss has no KL term; both weight slot k by exp(−(k−1)/γ), "
            f"γ = {settings.gamma:g}",
        },
        {
            "setting": "optimizer",
            "ours": "AdamW betas (0.9, 0.95), weight decay 0.01, clip 1.0 (optim.* defaults); "
            "fp32 weights, bf16 autocast",
            "specforge": "AdamW betas (0.9, 0.999), no weight decay, clip 0.5 "
            "(training.max_grad_norm default); bf16 weights with fp32 masters (BF16Optimizer)",
            "why": "each trainer's own defaults: only the clip is a setting of SpecForge's",
        },
        {
            "setting": "learning rate",
            "ours": f"{settings.lr:g}, {settings.warmup} warmup steps, cosine to 0 "
            "(optim.min_lr_ratio=0 here; its default is 0.1)",
            "specforge": f"{settings.lr:g}, warmup_ratio giving {settings.warmup} steps, cosine "
            "to 0",
            "why": "SpecForge's cosine always ends at 0",
        },
        {
            "setting": "feature noise",
            "ours": "uniform ±0.02 on the target's features (bench_eval's recipe)",
            "specforge": "none",
            "why": "SpecForge has no such option",
        },
        {
            "setting": "compute path",
            "ours": "drafter layers compiled, FlexAttention compiled with its own BlockMask"
            if gpu
            else "eager, SDPA with a dense mask (CPU)",
            "specforge": "eager layers, FlexAttention through transformers' integration "
            "(training.attention_backend default)"
            if gpu
            else "eager, SDPA with a dense mask (CPU: FlexAttention has no backward there)",
            "why": "each trainer's default on this device",
        },
        {
            "setting": "wrapping",
            "ours": "the drafter as it is (one GPU)",
            "specforge": f"training.fsdp_sharding={settings.specforge_sharding}"
            + (" (its default: FSDP, one rank)" if gpu else " (DDP: FSDP needs an accelerator)"),
            "why": "its default on a GPU; NO_SHARD is tried next when the first fails",
        },
        {
            "setting": "batches",
            "ours": "padded to a multiple of 128 tokens (data.bucket); the host draws the next "
            "batch while the device computes",
            "specforge": "padded to the batch's longest; "
            + (
                "its loader's workers (default 8) read the files"
                if settings.specforge_workers is None
                else f"{settings.specforge_workers} loader workers"
            ),
            "why": "each trainer's data path",
        },
        {
            "setting": "samples",
            "ours": "every generated answer (one without two consecutive supervised tokens "
            "adds no block)",
            "specforge": "those with two consecutive supervised tokens",
            "why": "its offline reader refuses the others",
        },
        {
            "setting": "τ probe",
            "ours": "off while training (eval.every=0)",
            "specforge": "none",
            "why": "SpecForge evaluates offline features only",
        },
    ]


def _entry(settings: Settings) -> tuple[str, dict[str, Any] | None]:
    """(what of SpecForge was measured, its training figures' stage result)."""
    train = read_stage(settings, "specforge-train")
    if train and train.get("ok"):
        attempt = train["trained"]
        how = (
            "its own training entry: specforge train (offline features from the same "
            f"target, training.fsdp_sharding={attempt['sharding']})"
        )
        how += (
            ", exported by its exporter"
            if "export" in attempt
            else f"; its exporter failed: {attempt.get('export_error')}"
        )
        failed = [a["sharding"] for a in train["attempts"] if a["error"]]
        if failed:
            how += f" (with {', '.join(failed)} it failed: see stages/specforge-train.json)"
        return how, {**attempt, "interop": train.get("interop"), "version": train.get("version")}
    modules = read_stage(settings, "specforge-modules")
    if modules and modules.get("ok"):
        return (
            "its modules (DFlashDraftModel, OnlineDFlashModel, BF16Optimizer) driven from this "
            f"project's data loop; its entry failed: {modules.get('why')}",
            modules,
        )
    return "nothing of it finished (see stages)", None


def _side(stage: dict[str, Any] | None, batch: int, data: dict[str, float], *, kl: bool) -> dict:
    if not stage or not stage.get("steady"):
        return {"peak_gib": (stage or {}).get("peak_gib")}
    flops = data["flops_per_sample_ours" if kl else "flops_per_sample_specforge"]
    figures = rates(stage["steady"]["step_s"], batch, data["tokens_per_sample"], flops)
    return {**figures, "peak_gib": stage.get("peak_gib"), "wall_s": stage.get("wall_s")}


def _data(settings: Settings) -> dict[str, Any] | None:
    """Tokens and model FLOPs per sample of the training data, worked out once (None before
    the data exist)."""
    if not (settings.root / "prepare.json").is_file():
        return None
    found = read_stage(settings, "data")
    if found is None:
        from bench.peer_recipe import drafter_shape, usable_samples

        shape = drafter_shape(settings)
        samples = usable_samples(settings)
        found = {**data_figures(settings, samples, shape), "samples": len(samples)}
        found["drafter"] = {k: v for k, v in asdict(shape).items() if k != "rope"}
        write_stage(settings, "data", found)
    return found


def summarize(
    settings: Settings, status: dict[str, dict[str, Any]], command: str
) -> dict[str, Any]:
    measured, sf_train = _entry(settings)
    data = _data(settings)
    ours_train = read_stage(settings, "ours-train")
    ours = _side(ours_train, settings.batch, data, kl=True) if data else {}
    theirs = _side(sf_train, settings.batch, data, kl=False) if data else {}
    evaluation = read_stage(settings, "evaluate") or {}
    for name, side in (("ours", ours), ("specforge", theirs)):
        row = (evaluation.get("drafters") or {}).get(name)
        side["tau"] = row["tau"] if row else None
        side["tau_interval"] = row.get("tau_interval") if row else None
        side["lossless"] = row.get("lossless") if row else None
    capture = read_stage(settings, "specforge-capture")
    if capture:
        theirs["capture_s"] = capture["seconds"]
    presence = status.get("specforge", {}).get("status", "")
    summary: dict[str, Any] = {
        "measured": presence if presence.startswith("absent") else measured,
        "gpu": (ours_train or {}).get("environment", {}).get("gpu") or settings.device,
        "ours": ours,
        "specforge": theirs,
        "ratios": _ratios(ours, theirs),
        "tau_difference": _difference(evaluation.get("ours_minus_specforge")),
        "prompt_lookup": _lookup(evaluation.get("prompt_lookup")),
        "reference": _reference(read_stage(settings, "reference")),
        "drafter_step_8b": _steps(settings),
        "interop": (sf_train or {}).get("interop"),
        "data": data,
        "differences": differences(settings),
        "settings": asdict(settings),
        "stages": status,
        "command": command,
    }
    return summary


def _ratios(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, float | None]:
    def ratio(key: str) -> float | None:
        a, b = ours.get(key), theirs.get(key)
        return a / b if a and b else None

    return {"tokens_per_s": ratio("tokens_per_s"), "peak_gib": ratio("peak_gib")}


def _difference(row: dict[str, Any] | None) -> dict[str, Any]:
    if not row:
        return {"value": None, "interval": None, "prompts": None}
    return {
        **row,
        "evaluator": "trainer.evaluation.report.evaluate (ours − SpecForge, paired 95 %)",
    }


def _lookup(row: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if not row else {"tau": row["tau"], "tau_interval": row.get("tau_interval")}


def _reference(result: dict[str, Any] | None) -> dict[str, Any] | None:
    if not result:
        return None
    if not result.get("ok"):
        return {"why": result.get("why")}
    drafters = {
        name: {k: v for k, v in row.items() if k != "prompt_counts"}
        for name, row in result["drafters"].items()
    }
    return {
        "prompts": result["prompts"],
        "drafters": drafters,
        "tau_difference": result.get("ours_minus_specforge"),
        "file": result.get("file"),
    }


def _steps(settings: Settings) -> dict[str, Any]:
    ours, theirs = read_stage(settings, "ours-step"), read_stage(settings, "specforge-step")
    out: dict[str, Any] = {"ours": ours, "specforge": theirs}
    if ours and theirs:
        out["tokens_per_s_ratio"] = ours["tokens_per_s"] / theirs["tokens_per_s"]
    return out


def markdown(s: dict[str, Any]) -> str:
    """The figures a reader compares first, then the differences."""

    def fmt(v: Any, spec: str = ".2f") -> str:
        return "—" if v is None else format(v, spec)

    o, t = s["ours"], s["specforge"]
    lines = [
        f"# Ours beside SpecForge ({s['gpu']})",
        "",
        f"SpecForge measured: {s['measured']}",
        "",
        "| figure | ours | SpecForge | ours ÷ SpecForge |",
        "| --- | --- | --- | --- |",
        f"| tokens/s (steady) | {fmt(o.get('tokens_per_s'), ',.0f')} | {fmt(t.get('tokens_per_s'), ',.0f')} | {fmt(s['ratios']['tokens_per_s'])} |",
        f"| step (ms) | {fmt(o.get('step_s') and 1e3 * o['step_s'], '.1f')} | {fmt(t.get('step_s') and 1e3 * t['step_s'], '.1f')} | |",
        f"| MFU (drafter model FLOPs) | {fmt(o.get('mfu'), '.3f')} | {fmt(t.get('mfu'), '.3f')} | |",
        f"| peak GiB | {fmt(o.get('peak_gib'))} | {fmt(t.get('peak_gib'))} | {fmt(s['ratios']['peak_gib'])} |",
        f"| held-out τ (this project's evaluator) | {fmt(o.get('tau'))} | {fmt(t.get('tau'))} | |",
    ]
    d = s["tau_difference"]
    if d.get("value") is not None:
        lo, hi = d["interval"]
        lines.append(
            f"| τ ours − SpecForge (paired 95 %) | {d['value']:+.2f} ({lo:+.2f}…{hi:+.2f}) | | |"
        )
    if s.get("prompt_lookup"):
        lines.append(f"| prompt lookup τ | {fmt(s['prompt_lookup']['tau'])} | | |")
    ref = s.get("reference") or {}
    for name in ("ours", "specforge"):
        row = (ref.get("drafters") or {}).get(name)
        if row:
            lines.append(
                f"| τ, z-lab's dflash_generate ({name}, {ref['prompts']} prompts) | {fmt(row['tau'])} | | |"
            )
    steps = s["drafter_step_8b"]
    for name in ("ours", "specforge"):
        row = steps.get(name)
        if row:
            lines.append(
                f"| 8B-shaped drafter step, {name}: tokens/s, MFU, peak GiB (drafter, optimizer, step) | {fmt(row['tokens_per_s'], ',.0f')}, {fmt(row['mfu'], '.3f')}, {fmt(row.get('peak_gib'))} | | |"
            )
    lines += ["", "| setting | ours | SpecForge | why |", "| --- | --- | --- | --- |"]
    lines += [
        f"| {d['setting']} | {d['ours']} | {d['specforge']} | {d['why']} |"
        for d in s["differences"]
    ]
    lines += ["", "| stage | status | seconds |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v['status']} | {v['seconds']:.0f} |" for k, v in s["stages"].items()]
    return "\n".join(lines)
