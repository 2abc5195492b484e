"""Tokens/s of the whole colocated training loop at the evaluation benchmark's shape.

    python bench/bench_train_loop.py --out loop.json            # one GPU, about a minute
    python bench/bench_train_loop.py --profile-steps 10         # and where those steps' time goes
    python bench/bench_train_loop.py --smoke --out /tmp/l.json  # tiny, on the CPU

The loop a user runs (`trainer.run.trainer.Trainer`: batches drawn on the host, the target's
features, the drafter's step, the log), not the drafter step alone (`profile_drafter.py`): at a
small drafter the host's share (drawing batches, launching kernels) decides the rate. The
target is a random Qwen3 of `bench_eval.py`'s recipe (8 × 768, vocabulary 8,192), the data
random token sequences of 200–256 tokens (the first 64 unsupervised), the drafter the
benchmark's (4 layers, B = 8, 128 sequences × 64 anchors a step, KL and noise on). The first
`--warmup` steps compile and are not timed; then `--steps` steps are timed end to end (tokens
are the batches' real tokens). `--profile-steps N` records N more steps with `run.profile_steps`
and adds their summary (wall and kernel time per step, kernels by kind).
"""

from __future__ import annotations

import json
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import environment, help_parser, sync, write
from trainer.settings.loading import add_overrides_option

FULL = {"hidden": 768, "layers": 8, "vocab": 8192, "batch": 128, "anchors": 64, "samples": 8192}
SMOKE = {"hidden": 64, "layers": 4, "vocab": 512, "batch": 4, "anchors": 8, "samples": 64}


def write_target(folder: Path, spec: dict[str, int]) -> None:
    """A random Qwen3 shaped as `bench_eval.py` shapes its target."""
    from transformers import Qwen3ForCausalLM

    from bench.eval_target import target_config

    cfg = target_config(spec["hidden"], spec["layers"], spec["vocab"], pad_token_id=0)
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).save_pretrained(str(folder))


def write_data(path: Path, spec: dict[str, int]) -> None:
    from trainer.data.dataset import Sample, write_samples

    rng = random.Random(0)
    samples = []
    for _ in range(spec["samples"]):
        n = rng.randrange(200, 257)
        ids = [rng.randrange(1, spec["vocab"]) for _ in range(n)]
        samples.append(Sample(ids, [False] * 64 + [True] * (n - 64)))
    write_samples(path, samples)


def loop_config(
    work: Path,
    spec: dict[str, int],
    device: str,
    steps: int,
    profile: int,
    overrides: Sequence[str] = (),
) -> Any:
    from trainer.settings.loading import config_from_dict

    return config_from_dict(
        {
            "model": {"target": str(work / "target"), "num_layers": 4, "block_size": 8},
            "data": {
                "path": str(work / "data.jsonl"),
                "batch_size": spec["batch"],
                "max_len": 256,
                "num_anchors": spec["anchors"],
                "bucket": 128,
                "noise": 0.02,
            },
            "optim": {"lr": 2e-3, "warmup_steps": 5},
            "run": {
                "steps": steps,
                "device": device,
                "checkpoint_every": 0,
                "log_every": 10**9,
                "profile_start": steps - profile,
                "profile_steps": profile,
                "tensorboard": False,
            },
        },
        overrides,
    )


def main(argv: list[str] | None = None) -> int:
    p = help_parser(__doc__)
    p.add_argument("--steps", type=int, default=150, help="timed steps")
    p.add_argument("--warmup", type=int, default=50, help="untimed steps first (compiles)")
    p.add_argument("--profile-steps", type=int, default=0, help="then profile this many steps")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (a check)")
    p.add_argument("--out", default=None, help="write the result as JSON")
    add_overrides_option(
        p,
        "a training-config override, e.g. run.compile_target=false (repeatable)",
    )
    p.add_argument("--keep-profile", default=None, help="copy the profile's files to this folder")
    args = p.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("needs a CUDA GPU (use --smoke for a CPU check)", file=sys.stderr)
        return 2
    from trainer.run.trainer import Trainer

    spec = SMOKE if args.smoke else FULL
    device = torch.device("cpu" if args.smoke else "cuda")
    total = args.warmup + args.steps + args.profile_steps
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        write_target(work / "target", spec)
        write_data(work / "data.jsonl", spec)
        config = loop_config(work, spec, device.type, total, args.profile_steps, args.overrides)
        lines: list[str] = []
        trainer = Trainer(config, work / "run", emit=lines.append)
        first = trainer.run(until=args.warmup)
        sync(device)
        began = time.perf_counter()
        timed = trainer.run(until=args.warmup + args.steps)
        sync(device)
        seconds = time.perf_counter() - began
        trainer.run()
        profiles = sorted((work / "run" / "profile").glob("*.json"))
        profile = json.loads(profiles[0].read_text()) if profiles else None
        if profiles and args.keep_profile:
            shutil.copytree(work / "run" / "profile", args.keep_profile, dirs_exist_ok=True)
    tokens = sum(r.tokens for r in timed)
    result = {
        "shape": spec,
        "drafter": {"layers": 4, "block_size": 8},
        "overrides": args.overrides,
        "env": environment(device),
        "timed_steps": len(timed),
        "ms_per_step": 1e3 * seconds / len(timed),
        "tokens_per_s": tokens / seconds,
        "loss_first": first[0].loss,
        "loss_last": timed[-1].loss,
        "profile": profile,
    }
    print(
        f"{result['timed_steps']} steps: {result['ms_per_step']:.1f} ms a step, "
        f"{result['tokens_per_s']:,.0f} tok/s (loss {result['loss_first']:.3f} → "
        f"{result['loss_last']:.3f})"
    )
    if profile is not None:
        print(next(line for line in lines if line.startswith("profile of steps")))
    write(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
