"""The demo job (`make run`'s: `trainer/configs/demo.toml`, its assets built fresh) timed under
variants of its settings, the variants interleaved so that a shared machine's load falls on
each alike.

    python bench/bench_demo_run.py --out demo-run.json \\
        --variant "heads4: demo.num_heads=4 demo.num_kv_heads=2" --variant "default:" \\
        [--repeat 3] [--steps 300]

Each run is `python -m trainer train --config trainer/configs/demo.toml --out W/run` in a fresh
work folder (the demo target and its data are built first, as on a first `make run`), with the
variant's `--set KEY=VALUE`s and `run.steps`. Per run: the wall time and the CPU time of the
process and its children (user + system: less moved by other load than the wall time), and the
machine's load average at the start; per variant the medians.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import environment, help_parser, write

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "trainer" / "configs" / "demo.toml"


def parse_variant(text: str) -> tuple[str, list[str]]:
    """`"name: key=value key=value"` → (name, the settings)."""
    name, _, rest = text.partition(":")
    if not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: a variant is NAME: KEY=VALUE …")
    return name.strip(), rest.split()


def one_run(settings: list[str], steps: int) -> dict[str, Any]:
    """One demo job in a fresh folder: wall and CPU seconds (children included)."""
    with tempfile.TemporaryDirectory(prefix="demo-run-") as work:
        argv = [sys.executable, "-m", "trainer", "train", "--config", str(DEMO)]
        argv += ["--out", f"{work}/run", "--set", f"run.steps={steps}"]
        for s in settings:
            argv += ["--set", s]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        load = os.getloadavg()[0]
        start = time.perf_counter()
        subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "load_at_start": round(load, 2)}


def main(argv: list[str] | None = None) -> int:
    p = help_parser(__doc__)
    p.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        required=True,
        help='"NAME: KEY=VALUE …": the --set overrides of one variant ("NAME:" for none); repeat',
    )
    p.add_argument("--repeat", type=int, default=3, help="runs of each variant, interleaved")
    p.add_argument("--steps", type=int, default=300, help="run.steps of each run")
    p.add_argument("--out", type=Path, default=None, help="the JSON record to write")
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in args.variant}
    for rep in range(args.repeat):
        for name, settings in args.variant:
            runs[name].append(one_run(settings, args.steps))
            print(f"[{rep + 1}/{args.repeat}] {name}: {runs[name][-1]}", flush=True)
    summary = {
        name: {
            "settings": settings,
            "median_wall_s": statistics.median(r["wall_s"] for r in runs[name]),
            "median_cpu_s": statistics.median(r["cpu_s"] for r in runs[name]),
        }
        for name, settings in args.variant
    }
    print("| variant | median wall s | median CPU s |\n| --- | --- | --- |")
    for name, s in summary.items():
        print(f"| {name} | {s['median_wall_s']:.1f} | {s['median_cpu_s']:.1f} |")
    if args.out is not None:
        env = {**environment(torch.device("cpu")), "cpus": os.cpu_count()}
        write(
            str(args.out),
            {"environment": env, "steps": args.steps, "variants": summary, "runs": runs},
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
