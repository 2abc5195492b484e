"""The seed's job at its own size on the machine at hand: a Qwen3.6-27B-shaped hybrid target
and the DFlash drafter published for it, through the trainer's own code, in one command:

    python bench/seed_size.py --out DIR                  # a GPU machine (1, 2, 4 or 8 GPUs)
    python bench/seed_size.py --cpu-smoke --out DIR      # the whole script on the CPU, tiny

Stages, the most important first, each in a process of its own under a time cap (a stage cut
short keeps the figures it has written), all within --budget-s (--stages picks some):
1. `target`: the feature forward as a target rank runs it (`trainer.model.target.load_target` on a
   config built in memory, random bf16 weights made on the GPU; `TargetWorker.for_run(…).
   produce`) at 4,096 / 16,384 / 49,152 tokens with the kernels transformers finds (fla's
   Triton gated delta rule with `dflash[kernels]`): tokens/s, MFU (`bench/flops.py`), peak
   memory, what ran each linear-attention operation (`trainer.model.linear_attention`); then the
   causal conv1d alone at the layers' shape, transformers' fallback beside fla's Triton kernel;
2. `drafter`: the drafter's training step at the seed's shape (2,048 blocks of 16 = 32,768
   queries over 49,152 context tokens, the 248,320-row loss) as a drafter rank runs it
   (`DrafterWorker.for_config(…).train_step` on the features a target rank sends): step time,
   MFU, peak memory, the default attention kernels;
3. `drafter-recompute`: stage 2 with `run.recompute_layers` (each layer keeps its inputs only
   and runs again in the backward): the memory a drafter rank saves and the time it pays;
4. `target-fallback`: stage 1 with `fla` and `causal_conv1d` unimportable, so transformers binds
   its pure-PyTorch reference; a length the cap cannot fit (predicted from the one before) is
   skipped and said so;
5. `drafter-flash`: stage 2 on FlexAttention's CuTe-DSL kernels (`run.attention_kernels =
   "flash"`) where flash-attn-4 imports, else why not;
6. `target-compiled`: stage 1's forward through `torch.compile` (`run.compile_target = true`);
7. `split`: with two GPUs or more, the real split run (`trainer.split.session`) at the planned split of
   this machine's GPUs: measured tokens/s beside the plan's prediction.
`--summarize` rewrites DIR/summary.json from the stage files in DIR (stages run by several calls,
each stage's file copied in) without running any. After every stage DIR/summary.json is rewritten: the figures so far and the plan
(`trainer.commands.plan.predict`) from the measured rates for 8, 4 and 2 GPUs with the memory of a rank
of each role, beside the seed's own 13.5 K (6 + 2) and 21.5 K (5 + 3) tokens/s. Each stage also
writes DIR/<stage>.json as it goes. The shapes and where they were read: bench/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import help_parser
from bench.seed_plan import plan_summary, summary_fields
from bench.seed_stages import read_json, say, write_json

STAGES = (
    "target",
    "drafter",
    "drafter-recompute",
    "target-fallback",
    "drafter-flash",
    "target-compiled",
    "split",
)
CAPS = {  # seconds (--caps changes them); a cold drafter compile alone takes minutes on an H200
    "target": 150,
    "drafter": 320,
    "drafter-recompute": 240,
    "target-fallback": 150,
    "drafter-flash": 300,
    "target-compiled": 240,
    "split": 420,
}
GPU_ONLY = ("drafter-flash", "target-compiled")
MIN_STAGE_S = 40  # a stage gets no start with less time than this left
MAX_IN_FLIGHT = 2  # split.max_in_flight's default: the batches a target rank may hold

# Qwen3.6-27B's language model (bench/README.md says where each figure was read)
SEED = {
    "target": dict(
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        full_attention_interval=4,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        max_position_embeddings=262144,
        rope_theta=1e7,
    ),
    # z-lab's DFlash drafter for Qwen3.6-27B: 5 layers (4 sliding-window of 2,048, then 1 full),
    # 32 heads of 128, 8 key/value heads, the target's MLP, features of target layers
    # 1, 16, 31, 46, 61, blocks of 16
    "drafter": dict(
        num_layers=5,
        num_heads=32,
        head_dim=128,
        num_kv_heads=8,
        sliding_window=2048,
        sliding_layers=[0, 1, 2, 3],
        block_size=16,
        num_target_layers=5,
    ),
    "lengths": [4096, 16384, 49152],
    "reps": {4096: (1, 3), 16384: (1, 2), 49152: (1, 1)},  # (untimed, timed) forwards
    "seq_len": 49152,
    "num_anchors": 2048,
    "warmup_steps": 2,
    "timed_steps": 3,
    "split_steps": 10,
    "split_warmup": 4,
}
SMOKE = {
    "target": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        full_attention_interval=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
        rope_theta=1e7,
    ),
    "drafter": dict(
        num_layers=2,
        num_heads=8,
        head_dim=8,
        num_kv_heads=2,
        sliding_window=32,
        sliding_layers=[0],
        block_size=4,
        num_target_layers=2,
    ),
    "lengths": [64, 128, 256],
    "reps": {64: (1, 2), 128: (0, 1), 256: (0, 1)},
    "seq_len": 256,
    "num_anchors": 16,
    "warmup_steps": 1,
    "timed_steps": 2,
    "split_steps": 4,
    "split_warmup": 1,
}


# ---- running the stages ------------------------------------------------------------------------


# Stages run once more when they fail: the split's spawned ranks have aborted now and then on a
# loaded CPU (SIGABRT, `terminate called without an active exception`); the record says so.
TRIED_TWICE = ("split",)


def run_stage(name: str, args: argparse.Namespace, timeout: float) -> dict[str, Any]:
    """One stage in its own process group, killed whole at `timeout` (its compile workers
    too); returns how it ended. Its figures are in <out>/<name>.json."""
    argv = [sys.executable, str(Path(__file__).resolve()), "--stage", name, "--out", args.out]
    argv += ["--cap", f"{timeout:.0f}"] + (["--cpu-smoke"] if args.cpu_smoke else [])
    began = time.perf_counter()
    proc = subprocess.Popen(argv, start_new_session=True)
    try:
        code = proc.wait(timeout=timeout)
        ended = "done" if code == 0 else f"failed (exit {code})"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        ended = f"cut at its cap of {timeout:.0f} s"
    return {"ended": ended, "wall_s": round(time.perf_counter() - began, 1)}


def orchestrate(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget_s
    caps = {**CAPS, **args.caps}
    wanted = [s for s in STAGES if s in args.stages.split(",")]
    if not wanted:
        print(f"--stages: none of {', '.join(STAGES)}", file=sys.stderr)
        return 2
    runs: dict[str, Any] = {}
    summary: dict[str, Any] = {}
    for name in wanted:
        left = deadline - time.perf_counter()
        if left < MIN_STAGE_S:
            runs[name] = {"ended": f"not started: {left:.0f} s of the budget left"}
        elif args.cpu_smoke and name in GPU_ONLY:
            runs[name] = {"ended": "not started: a GPU stage"}
        else:
            cap = min(caps[name] if not args.cpu_smoke else args.caps.get(name, 600), left)
            say(f"stage {name}: up to {cap:.0f} s", indent="")
            runs[name] = run_stage(name, args, cap)
            again = min(cap, deadline - time.perf_counter())  # within the budget still left
            if name in TRIED_TWICE and runs[name]["ended"].startswith("failed") and again > 0:
                first = runs[name]["ended"]
                say(f"stage {name}: {first}; once more", indent="")
                runs[name] = run_stage(name, args, again)
                runs[name]["ended"] += f" (second try; the first {first})"
            say(f"stage {name}: {runs[name]['ended']} after {runs[name]['wall_s']} s", indent="")
        for stray in out.glob("*.tmp"):  # a write cut by the cap: only whole files come back
            stray.unlink()
        stages = {s: read_json(out / f"{s}.json") for s in wanted}
        summary = summary_fields(stages, runs, max_in_flight=MAX_IN_FLIGHT)
        summary["plan"] = plan_summary(summary)
        write_json(out / "summary.json", summary)
    print(json.dumps(headline(summary), indent=2))
    for gpus, rep in summary["plan"].get("reports", {}).items():
        print(f"\nplan for {gpus} GPUs (the seed: {summary['plan']['seed_tokens_per_s']}):")
        print(rep["text"])
    print(f"memory per rank: {summary['plan']['memory']}")
    return 0


def summarize(out: Path) -> int:
    """summary.json again from the stage files in `out`; how each stage ended is kept from the
    summary already there."""
    old = read_json(out / "summary.json") or {}
    runs = {s: old.get("stages", {}).get(s, {"ended": "from its file"}) for s in STAGES
            if (out / f"{s}.json").exists()}  # fmt: skip
    stages = {s: read_json(out / f"{s}.json") for s in STAGES}
    summary = summary_fields(stages, runs, max_in_flight=MAX_IN_FLIGHT)
    summary["plan"] = plan_summary(summary)
    write_json(out / "summary.json", summary)
    print(json.dumps(headline(summary), indent=2))
    return 0


def parse_caps(text: str) -> dict[str, float]:
    """`drafter=400,target=200` → {"drafter": 400.0, "target": 200.0}."""
    caps = {}
    for item in filter(None, text.split(",")):
        name, _, seconds = item.partition("=")
        if name not in STAGES or not seconds.replace(".", "", 1).isdigit():
            raise argparse.ArgumentTypeError(f"{item!r}: STAGE=SECONDS, STAGE one of {STAGES}")
        caps[name] = float(seconds)
    return caps


def headline(summary: dict[str, Any]) -> dict[str, Any]:
    """The record's figures without the per-row detail (the log shows them; summary.json has
    them all)."""
    t, d = summary["target"], summary["drafter"]
    keep = ("tokens", "tokens_per_s", "mfu", "peak_gib", "linear_attention", "fallback_tokens",
            "fallback_tokens_per_s", "fallback_mfu", "kernels_over_fallback", "conv")  # fmt: skip
    plan = {k: summary["plan"].get(k) for k in ("best_split", "best_tokens_per_s", "memory")}
    return {
        "gpu": summary["gpu"],
        "torch": summary["torch"],
        "target": {k: t.get(k) for k in keep},
        "drafter": {k: d.get(k) for k in ("mfu", "peak_gib", "step_s", "tokens_per_s")}
        | {"recompute": _figures(d["recompute"]), "flash": _figures(d["flash_kernels"])},
        "plan": plan,
        "split": summary["split"] and {k: v for k, v in summary["split"].items() if k != "env"},
        "stages": summary["stages"],
    }


def _figures(step: dict[str, Any]) -> dict[str, Any]:
    keep = ("mfu", "peak_gib", "step_s", "tokens_per_s", "unavailable")
    return {k: step[k] for k in keep if k in step}


def main(argv: list[str] | None = None) -> int:
    parser = help_parser(__doc__)
    parser.add_argument("--out", required=True, help="folder for summary.json and the stages")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--budget-s", type=float, default=520, help="all stages together")
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated, in order")
    parser.add_argument(
        "--caps", type=parse_caps, default={}, help="STAGE=SECONDS,… (default: CAPS above)"
    )
    parser.add_argument(
        "--summarize", action="store_true", help="rewrite summary.json from DIR's stage files"
    )
    parser.add_argument("--stage", help=argparse.SUPPRESS)  # one stage, in its own process
    parser.add_argument("--cap", type=float, default=600, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.stage:
        from bench.seed_stages import run

        spec = SMOKE if args.cpu_smoke else SEED
        return run(args.stage, spec, Path(args.out), cap_s=args.cap, smoke=args.cpu_smoke)
    if args.summarize:
        return summarize(Path(args.out))
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
