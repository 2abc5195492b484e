"""Drafter experiments kept as data: a recipe file's runs, by one command.

    python -m bench.recipes run bench/recipes/depth.toml --work /tmp/w --out /tmp/out
    python -m bench.recipes run bench/recipes/kv-heads.toml --work W --out R --only kv2
    python -m bench.recipes run bench/recipes/depth.toml --work W --out R --smoke   # CPU, tiny
    python -m bench.recipes check bench/recipes/*.toml   # every run's options; nothing runs

`run` first checks every run's options with `bench_eval.py`'s own parser (a typo is refused by
name before a target trains), then makes the target and the data once (the file's `[[prepare]]`
runs, unless `--skip-prepare`: they are in `--work` already), then trains and measures each
recipe (`bench/compare_recipes.py`: all at once over the visible GPUs, recipe i on GPU i mod n,
or one after another where the file says `one_at_a_time`), writing `<out>/<run>.json`, `.log`
and `summary.md` (every recipe's τ, then each against the first, paired over the same prompts).
`--smoke` runs the same at `bench_eval.py --smoke`'s tiny sizes on the CPU. The file's format:
`bench/recipes/plan.py`; how a run becomes a record: `bench/results/README.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

from bench.common import log
from bench.compare_recipes import prepare, run_recipes
from bench.recipes.plan import Plan, RecipeError, load_plan


def check(plan: Plan, work: Path) -> None:
    """Each run's options as `bench_eval.py` reads them; RecipeError naming the run if refused."""
    from bench.bench_eval import parse_args

    runs = [(r, [str(work), "--prepare-only"]) for r in plan.prepare]
    runs += [(r, [str(work / r.name), "--reuse-target"]) for r in plan.recipes]
    for run, head in runs:
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):
                parse_args(["--work", *head, "--out", f"{run.name}.json", *run.options])
        except SystemExit as exc:
            why = (stderr.getvalue().strip().splitlines() or [f"exit {exc.code}"])[-1]
            why = why.partition("error: ")[2] or why
            raise RecipeError(f"{plan.source}, {run.name}: {why}") from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.recipes", description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run a recipe file")
    run_p.add_argument("file", type=Path, help="a recipe file, e.g. bench/recipes/depth.toml")
    run_p.add_argument("--work", required=True, type=Path, help="the shared target and data")
    run_p.add_argument("--out", required=True, type=Path, help="each run's JSON and log")
    run_p.add_argument("--only", help="these recipes, comma-separated (default: all)")
    run_p.add_argument("--skip-prepare", action="store_true", help="the data are in --work")
    run_p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    check_p = sub.add_parser("check", help="print each run's options; run nothing")
    check_p.add_argument("files", nargs="+", type=Path)
    check_p.add_argument("--smoke", action="store_true", help="as --smoke would run them")
    args = p.parse_args(argv)
    try:
        if args.command == "check":
            for path in args.files:
                plan = load_plan(path, smoke=args.smoke)
                check(plan, Path("{work}"))
                print(f"{path}: {plan.about}")
                for r in plan.prepare + plan.recipes:
                    print(f"  {r.name}: {' '.join(r.options)}")
            return 0
        work, out = args.work.resolve(), args.out.resolve()
        only = [n.strip() for n in args.only.split(",")] if args.only else None
        plan = load_plan(args.file, work=str(work), smoke=args.smoke, only=only)
        check(plan, work)
    except RecipeError as exc:
        p.error(str(exc))
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    log(f"{plan.source}: {plan.about}")
    for step in [] if args.skip_prepare else plan.prepare:
        prepare(work, out, step.options, step.name)
    recipes = [(r.name, r.options) for r in plan.recipes]
    return run_recipes(work, out, recipes, one_at_a_time=plan.one_at_a_time)


if __name__ == "__main__":
    sys.exit(main())
