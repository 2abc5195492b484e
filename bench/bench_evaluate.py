"""How long a drafter's evaluation takes: prompts decoded one at a time against in batches.

    python bench/bench_evaluate.py --out evaluate.json          # one GPU, bench_eval's target shape
    python bench/bench_evaluate.py --smoke --out /tmp/e.json    # tiny, CPU

The same `trainer.evaluation.report.evaluate` twice per drafter (a random 4-layer DFlash drafter, and
prompt lookup), lossless check included: `--batch-tokens 1` (one prompt per forward, as the
evaluator ran before batching) and the default `BATCH_TOKENS`. A random target in fp32 (as
`bench_eval.py` evaluates) at the shape of `bench_eval.py`'s target, random prompts; the figures
are seconds per evaluation, their ratio, and whether both runs gave the same per-prompt counts
(in fp32 a batched forward may round differently from a single one, so a rare argmax tie can
tell them apart; the CPU tests check equality in float64).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_generate import SHAPES  # noqa: E402
from bench.common import environment, help_parser, markdown, sync, write  # noqa: E402
from trainer.evaluation.drafters import BlockDrafter, DFlashDrafter  # noqa: E402
from trainer.evaluation.prompt_lookup import PromptLookupDrafter  # noqa: E402
from trainer.evaluation.report import evaluate  # noqa: E402
from trainer.evaluation.speculative import BATCH_TOKENS  # noqa: E402
from trainer.model.drafter import Drafter, shape_from_target  # noqa: E402
from trainer.model.target import Target, load_target  # noqa: E402
from trainer.settings.config import ModelConfig  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = help_parser(__doc__)
    p.add_argument(
        "--shape", default="eval-target", choices=sorted(SHAPES), help="the random target's shape"
    )
    p.add_argument("--prompts", type=int, default=32, help="evaluation prompts")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per prompt")
    p.add_argument("--block-size", type=int, default=8, help="the drafter's block size")
    p.add_argument("--drafter-layers", type=int, default=4, help="the random drafter's layers")
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=BATCH_TOKENS,
        help="the batched run's tokens per forward (trainer.evaluation.evaluate --batch-tokens)",
    )
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.prompts, args.prompt_len, args.max_new_tokens = "smoke", 6, 8, 12
        args.block_size, args.drafter_layers = 4, 1
    return args


def random_target(shape: str, device: torch.device) -> Target:
    from transformers import Qwen3Config

    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False)
    target = load_target(cfg, device=device, seed=0)
    target.model.float()
    return target


def random_drafter(target: Target, args: argparse.Namespace) -> DFlashDrafter:
    torch.manual_seed(0)
    model = ModelConfig(num_layers=args.drafter_layers, block_size=args.block_size)
    shape = shape_from_target(target.config, model, num_features=len(target.layers))
    return DFlashDrafter(
        Drafter(shape).to(target.device),
        embed_weight=target.embed_weight,
        lm_head_weight=target.lm_head_weight,
    )


def timed(
    target: Target,
    drafter: BlockDrafter,
    prompts: list[list[int]],
    args: argparse.Namespace,
    batch_tokens: int,
    reps: int = 2,
) -> dict:
    """The fastest of `reps` evaluations (the first meets new shapes) and its report."""
    best = float("inf")
    for _ in range(reps):
        sync(target.device)
        start = time.perf_counter()
        report = evaluate(
            target, drafter, prompts, max_new_tokens=args.max_new_tokens, batch_tokens=batch_tokens
        )
        sync(target.device)
        best = min(best, time.perf_counter() - start)
    return {"seconds": best, "report": report}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    target = random_target(args.shape, device)
    gen = torch.Generator().manual_seed(1)
    vocab = SHAPES[args.shape]["vocab_size"]
    prompts = torch.randint(1, vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
    drafters = {
        "dflash (random, 4 layers)": random_drafter(target, args),
        "prompt lookup": PromptLookupDrafter(args.block_size),
    }
    rows = []
    for name, drafter in drafters.items():
        alone = timed(target, drafter, prompts, args, 1)
        together = timed(target, drafter, prompts, args, args.batch_tokens)
        a, t = alone["report"], together["report"]
        rows.append(
            {
                "drafter": name,
                "one at a time, s": alone["seconds"],
                "batched, s": together["seconds"],
                "speed-up": alone["seconds"] / together["seconds"],
                "tau one at a time": a.tau,
                "tau batched": t.tau,
                "same counts": a.prompt_counts == t.prompt_counts,
            }
        )
    columns = list(rows[0])
    print(markdown(rows, columns))
    write(
        args.out,
        {
            "shape": args.shape,
            "prompts": args.prompts,
            "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new_tokens,
            "batch_tokens": args.batch_tokens,
            "rows": rows,
            "environment": environment(device),
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
