"""Drafter recipes side by side on one target and one set of data, on one GPU or several.

    python bench/compare_recipes.py --work /tmp/recipes --out results/ \\
        --prepare "--samples 49152 --gen-temperatures 0,1" \\
        --recipe "prefix: --train-data {work}/generated-unseen-t1-p16" \\
        --recipe "mix: --train-data {work}/generated-unseen,{work}/generated-unseen-t1-p16"

The engine of `python -m bench.recipes` (recipes kept as files: `bench/recipes/*.toml`), and its
command line for recipes typed out. First `bench_eval.py --prepare-only` trains the target and
generates the data into `--work` (its arguments from `--prepare`; its JSON and log in `--out`);
then every recipe runs as its own `bench_eval.py --reuse-target` process, all at once (a drafter
step leaves most of an H200 idle, so recipes that share it finish together far sooner than one
after another), spread over the visible GPUs in turn (recipe i on GPU i mod n), each in its own
work folder beside the shared target, and writes `<out>/<name>.json` (`--one-at-a-time`: in
order, one after another, so that a machine taken back midway keeps the recipes that finished).
`{work}` in a recipe is `--work`. The τ figures do not depend on the sharing; the step times and
the training seconds do. `<out>/summary.md` holds a row per recipe and point, then each recipe's
held-out τ against the first recipe's with a paired interval over the same prompts
(`trainer.evaluation.tau_bootstrap`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "bench_eval.py"
if str(ROOT) not in sys.path:  # the trainer package, when run as a script
    sys.path.insert(0, str(ROOT))

from bench.common import help_parser, log  # noqa: E402


def parse_recipe(text: str) -> tuple[str, str]:
    name, sep, rest = text.partition(":")
    name = name.strip()
    if not sep or not name.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected 'name: --option value …', got {text!r}")
    return name, rest


def prepare(work: Path, out: Path, options: list[str], name: str = "prepare") -> None:
    """The target and the data in `work` (`bench_eval.py --prepare-only` with `options`), its
    JSON and log as `<out>/<name>.json` and `.log`."""
    argv = [sys.executable, str(BENCH), "--work", str(work), "--prepare-only"]
    argv += ["--out", str(out / f"{name}.json"), *options]
    log(f"{name}: " + shlex.join(argv[1:]))
    with (out / f"{name}.log").open("w") as log_file:
        code = subprocess.run(argv, stdout=log_file, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"{name} failed ({code}): see {out / f'{name}.log'}")


def visible_gpus() -> list[str]:
    """The GPUs recipes may use: CUDA_VISIBLE_DEVICES where set, else every GPU torch sees."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [gpu for gpu in listed.split(",") if gpu.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def gpu_env(index: int, gpus: list[str]) -> dict[str, str]:
    """The environment of recipe `index`: its one GPU, in turn over `gpus` (none: unchanged)."""
    if not gpus:
        return dict(os.environ)
    return {**os.environ, "CUDA_VISIBLE_DEVICES": gpus[index % len(gpus)]}


def start(
    name: str, options: list[str], work: Path, out: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """One recipe's `bench_eval.py --reuse-target` in `work/<name>` (the target linked in)."""
    folder = work / name
    folder.mkdir(exist_ok=True)
    link = folder / "target"
    if not link.exists():
        link.symlink_to(work / "target", target_is_directory=True)
    argv = [sys.executable, str(BENCH), "--work", str(folder), "--reuse-target"]
    argv += ["--out", str(out / f"{name}.json"), *options]
    gpu = env.get("CUDA_VISIBLE_DEVICES")
    log(f"{name}{f' (GPU {gpu})' if gpu is not None else ''}: " + shlex.join(argv[1:]))
    with (out / f"{name}.log").open("w") as log_file:  # the child keeps its own copy
        return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, env=env)


def run_recipes(
    work: Path, out: Path, recipes: list[tuple[str, list[str]]], *, one_at_a_time: bool
) -> int:
    """Every recipe on the prepared `work` (see the module's docstring), then the summary;
    1 if any failed (its log says why), else 0."""
    gpus = visible_gpus()
    names = [name for name, _ in recipes]
    if one_at_a_time:
        failed = []
        for i, (name, options) in enumerate(recipes):
            if start(name, options, work, out, gpu_env(i, gpus)).wait() != 0:
                failed.append(name)
            rows = write_summary(out, names)
    else:
        procs = {
            name: start(name, options, work, out, gpu_env(i, gpus))
            for i, (name, options) in enumerate(recipes)
        }
        failed = [name for name, proc in procs.items() if proc.wait() != 0]
        rows = write_summary(out, names)
    print("\n".join(rows))
    if failed:
        log(f"failed: {', '.join(failed)} (see their logs in {out})")
    return 1 if failed else 0


def load_results(out: Path, names: list[str]) -> dict[str, dict[str, Any] | None]:
    """Each recipe's `<out>/<name>.json`, None where it wrote none: read once for both tables."""
    paths = {name: out / f"{name}.json" for name in names}
    return {n: json.loads(p.read_text()) if p.is_file() else None for n, p in paths.items()}


def summary(results: dict[str, dict[str, Any] | None]) -> list[str]:
    rows = [
        "| recipe | samples | steps | epochs | held-out τ (95 % interval) | exported τ "
        "| prompt lookup τ | training-prompt τ | held-out acc% at every position "
        "| speed-up, drafts paid for |"
    ]
    rows.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, result in results.items():
        if result is None:
            rows.append(f"| {name} | (no result) | | | | | | | | |")
            continue
        for point in result.get("points", []):
            exported = point.get("exported")  # results written before it was measured lack it
            exported_tau = f"{exported['tau']:.2f}" if exported else "—"
            rows.append(
                f"| {name} | {point['samples']:,} | {point['drafter']['steps']:,} "
                f"| {point['epochs']:.1f} | {with_interval(point['held_out'])} "
                f"| {exported_tau} "
                f"| {point['baselines']['prompt_lookup']['tau']:.2f} "
                f"| {point['train_prompts']['tau']:.2f} "
                f"| {percents(point['held_out'].get('slot_accuracy'))} "
                f"| {paid_for(point['held_out'])} |"
            )
    return rows


def paid_for(report: dict) -> str:
    """`1.61× (drafts 0.61)`: the speed-up with every draft counted at its cost
    (`trainer.evaluation.draft_cost`); reports written before it was counted lack it."""
    net, cost = report.get("net_speedup"), report.get("draft_cost")
    return "—" if net is None or cost is None else f"{net:.2f}× (drafts {cost:.2f})"


def with_interval(report: dict) -> str:
    """`2.05 (1.91–2.19)`: τ and its 95 % interval over the prompts, where the report has it."""
    interval = report.get("tau_interval")
    spread = f" ({interval[0]:.2f}–{interval[1]:.2f})" if interval else ""
    return f"{report['tau']:.2f}{spread}"


def paired(results: dict[str, dict[str, Any] | None]) -> list[str]:
    """Each recipe's held-out τ against the first one's (of those with a result), point by
    point, with the 95 % paired bootstrap interval over the same prompts
    (`trainer.evaluation.tau_bootstrap`): a difference whose interval excludes 0 is one these prompts can
    tell."""
    from trainer.evaluation.tau_bootstrap import tau_difference

    names = [n for n, r in results.items() if r is not None]
    found = {n: r for n, r in results.items() if r is not None and r.get("points")}
    if len(found) < 2 or names[0] not in found:
        return []
    base = found.pop(names[0])["points"]
    rows = [
        "",
        f"| recipe | samples | held-out τ − {names[0]}'s (95 % paired interval) |",
        "| --- | --- | --- |",
    ]
    for name, result in found.items():
        for point, ref in zip(result["points"], base, strict=False):
            a, b = point["held_out"].get("prompt_counts"), ref["held_out"].get("prompt_counts")
            if not a or not b or len(a) != len(b):
                continue  # older reports, or other prompts
            diff, lo, hi = tau_difference(a, b)
            rows.append(f"| {name} | {point['samples']:,} | {diff:+.2f} ({lo:+.2f}…{hi:+.2f}) |")
    return rows if len(rows) > 3 else []


def write_summary(out: Path, names: list[str]) -> list[str]:
    """`<out>/summary.md` from the results written so far (one yet to finish: "no result")."""
    results = load_results(out, names)
    rows = summary(results) + paired(results)
    (out / "summary.md").write_text("\n".join(rows) + "\n")
    return rows


def percents(rates: list[float] | None) -> str:
    return "—" if rates is None else " ".join(f"{100 * r:.0f}" for r in rates)


def main(argv: list[str] | None = None) -> int:
    p = help_parser(__doc__)
    p.add_argument("--work", required=True, help="the shared target and data")
    p.add_argument("--out", required=True, help="folder for <recipe>.json and .log")
    p.add_argument("--prepare", default="", help="bench_eval.py arguments of the preparation")
    p.add_argument("--skip-prepare", action="store_true", help="the target and data exist")
    p.add_argument(
        "--recipe", type=parse_recipe, action="append", required=True,
        help="'NAME: bench_eval.py options' (repeatable; {work} is --work)",
    )  # fmt: skip
    p.add_argument(
        "--one-at-a-time", action="store_true",
        help="run the recipes one after another in the order given, the summary rewritten "
        "after each: on a machine that may be taken back, the finished ones stay",
    )  # fmt: skip
    args = p.parse_args(argv)
    work, out = Path(args.work).resolve(), Path(args.out).resolve()
    if len({name for name, _ in args.recipe}) != len(args.recipe):
        p.error("recipe names must differ")
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    if not args.skip_prepare:
        prepare(work, out, shlex.split(args.prepare))
    recipes = [(n, shlex.split(o.replace("{work}", str(work)))) for n, o in args.recipe]
    return run_recipes(work, out, recipes, one_at_a_time=args.one_at_a_time)


if __name__ == "__main__":
    sys.exit(main())
