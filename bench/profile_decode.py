"""Where a decode step of `trainer.generation.decode` spends its time, and tokens/s by batch size.

    python bench/profile_decode.py --out DIR/                 # one GPU, about a minute
    python bench/profile_decode.py --smoke --out /tmp/p.json  # tiny, on the CPU

A random target at `--shape` (default: the evaluation benchmark's 8-layer, hidden-768 target)
answers random prompts of `--prompt-len` tokens with no end token (every answer runs to
`--max-new-tokens`), once per batch size of `--batch-sizes`, each engine of `--engines`. Then
`torch.profiler` records one batch: the operators by self CPU time and by self device time, and
the step's wall time beside the device's busy time — a step far longer than its kernels is paid
in launch and Python overhead, not in arithmetic.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.bench_generate import build_model  # noqa: E402
from bench.common import environment, help_parser, markdown, sync, write  # noqa: E402
from trainer.generation.decode import ENGINES, decode_batch  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = help_parser(__doc__)
    p.add_argument(
        "--shape",
        default="eval-target",
        help="the random target's shape (bench_generate.py's shapes)",
    )
    p.add_argument("--batch-sizes", default="512,2048", help="batch sizes, comma-separated")
    p.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help="trainer.generation.decode engines, comma-separated",
    )
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per answer")
    p.add_argument(
        "--profile-batch", type=int, default=512, help="the batch size of the profiled batch"
    )
    p.add_argument("--profile-steps", type=int, default=16, help="decode steps profiled")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--out", default=None, help="JSON file, or a folder (then OUT/decode.json)")
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.batch_sizes, args.prompt_len = "smoke", "4", 6
        args.max_new_tokens, args.profile_batch, args.profile_steps = 8, 4, 4
    return args


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(count)
    return torch.randint(0, vocab, (count, length), generator=gen).tolist()


def timed(model: Any, rows: list[list[int]], new: int, engine: str, device: torch.device) -> float:
    sync(device)
    start = time.perf_counter()
    decode_batch(model, rows, max_new_tokens=new, eos_ids=(), pad_id=0, engine=engine)
    sync(device)
    return time.perf_counter() - start


def throughput(model: Any, args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    rows = []
    for engine in args.engines.split(","):
        for b in (int(x) for x in args.batch_sizes.split(",")):
            batch = prompts(b, args.prompt_len, model.config.vocab_size)
            timed(model, batch, 4, engine, device)  # warm-up (and, for graphs, capture)
            seconds = timed(model, batch, args.max_new_tokens, engine, device)
            tokens = b * args.max_new_tokens
            rows.append({"engine": engine, "batch": b, "seconds": seconds,
                         "ms_per_step": 1e3 * seconds / args.max_new_tokens,
                         "tokens_per_s": tokens / seconds})  # fmt: skip
            print(markdown(rows[-1:], list(rows[-1])), flush=True)
    return rows


def profile(model: Any, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as record

    batch = prompts(args.profile_batch, args.prompt_len, model.config.vocab_size)
    engine = args.engines.split(",")[0]
    timed(model, batch, 4, engine, device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with record(activities=activities) as prof:
        wall = timed(model, batch, args.profile_steps, engine, device)
    table = prof.key_averages()
    device_us = sum(e.self_device_time_total for e in table)
    tables = {"by_cpu": table.table(sort_by="self_cpu_time_total", row_limit=25)}
    if device.type == "cuda":
        tables["by_device"] = table.table(sort_by="self_cuda_time_total", row_limit=25)
    for name, text in tables.items():
        print(f"\n{name}:\n{text}", flush=True)
    return {
        "engine": engine,
        "batch": args.profile_batch,
        "steps": args.profile_steps,
        "wall_ms_per_step": 1e3 * wall / args.profile_steps,
        "device_busy_ms_per_step": device_us / 1e3 / args.profile_steps,
        "tables": tables,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    model = build_model(args.shape, device, 0)
    rows = throughput(model, args, device)
    prof = profile(model, args, device)
    print(f"profiled step: wall {prof['wall_ms_per_step']:.2f} ms, "
          f"device busy {prof['device_busy_ms_per_step']:.2f} ms")  # fmt: skip
    if args.out and (Path(args.out).is_dir() or args.out.endswith("/")):
        Path(args.out).mkdir(parents=True, exist_ok=True)
        args.out = str(Path(args.out) / "decode.json")
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    write(args.out, {"settings": settings, "env": environment(device), "rows": rows,
                     "profile": prof})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
