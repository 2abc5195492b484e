"""Where one drafter training step spends its GPU time, at the two-GPU benchmark's shapes.

    python bench/profile_drafter.py [--steps 2] [--out drafter-profile.json]   # one GPU
    python bench/profile_drafter.py --smoke                                    # CPU, tiny

Same model, data and settings as `bench_pipeline.py` (Qwen3-8B-shaped random target, 5-layer
drafter, 4,096 tokens, 512 anchors): the target produces the features once, then the drafter's
`train_step` runs a few times untimed (compiles) and `--steps` times under the profiler. Prints
the kernels sorted by GPU time and a summary by kind — attention forward and backward
(FlexAttention on a GPU), the BlockMask, matrix multiplies, the loss's kernels, the optimizer,
the rest — with each kind's share of the step, the step's wall time and the drafter MFU it
implies, so that the distance to the MFU goal can be attributed before it is worked on.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.bench_pipeline import (
    FULL,
    PEAK_BF16,
    SMOKE,
    drafter_flops,
    mask_density,
    target_config,
    train_config,
    write_data,
)

# First match wins: kernel name pattern → kind.
KINDS = [
    ("attention backward", re.compile(r"(flex|flash|attention).*(bwd|backward)", re.I)),
    ("attention forward", re.compile(r"flex|flash|attention", re.I)),
    ("block mask", re.compile(r"mask|create_block", re.I)),
    ("loss kernels", re.compile(r"_stats_kernel|_grad_kernel|logsumexp|cross_entropy", re.I)),
    (
        "matmul",
        re.compile(r"gemm|gemv|cutlass|nvjet|sm90|sm80|cublas|matmul|aten::(mm|addmm|bmm)$", re.I),
    ),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("communication", re.compile(r"nccl", re.I)),
]


def kind_of(name: str) -> str:
    return next((k for k, pattern in KINDS if pattern.search(name)), "other")


def summarize(events: list[tuple[str, float]], step_us: float) -> list[dict]:
    """(kernel name, total µs) over the profiled steps → one row per kind, share of the step."""
    totals: dict[str, float] = {}
    for name, us in events:
        totals[kind_of(name)] = totals.get(kind_of(name), 0.0) + us
    return [
        {"kind": k, "ms_per_step": v / 1e3, "share_of_step": v / step_us}
        for k, v in sorted(totals.items(), key=lambda kv: -kv[1])
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2, help="profiled drafter steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles)")
    parser.add_argument("--out", default=None, help="also write the summary as JSON")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (a check)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("needs a CUDA GPU (use --smoke for a CPU check)", file=sys.stderr)
        return 2
    spec = SMOKE if args.smoke else FULL
    device = torch.device("cpu" if args.smoke else "cuda")

    from trainer.data import BatchStream, load_samples
    from trainer.pipeline import DrafterWorker, TargetWorker
    from trainer.target import load_target

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        write_data(data, spec)
        cfg = train_config(spec, data, device=device.type, steps=100)
        target = load_target(target_config(spec), device=device, num_layers=5, seed=0)
        stream = BatchStream(load_samples(data), cfg.data, block_size=cfg.model.block_size, seed=0)
        producer = TargetWorker(target)
        n = args.warmup + args.steps
        features = [producer.produce(stream.next_batch()) for _ in range(n)]
        density = mask_density(spec, data, device)
    torch.manual_seed(0)
    worker = DrafterWorker.for_target(target, cfg, device)
    for i in range(args.warmup):
        worker.train_step(features[i], i)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(args.warmup, n):
            worker.train_step(features[i], i)  # ends with a host sync (.tolist())
    step_s = (time.perf_counter() - start) / args.steps
    averages = prof.key_averages()
    gpu = device.type == "cuda"
    events = [
        (e.key, (e.device_time_total if gpu else e.self_cpu_time_total) / args.steps)
        for e in averages
        if (e.device_time_total if gpu else e.self_cpu_time_total) > 0
        and (not gpu or e.device_type == torch.autograd.DeviceType.CUDA)
    ]
    rows = summarize(events, step_s * 1e6)
    flops = drafter_flops(spec, density)
    result = {
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "torch": torch.__version__,
        "step_ms": step_s * 1e3,
        "tokens_per_s": spec["seq_len"] / step_s,
        "mfu_vs_peak": flops / step_s / PEAK_BF16,
        "busy_share": sum(r["share_of_step"] for r in rows),
        "kinds": rows,
    }
    sort = "cuda_time_total" if gpu else "self_cpu_time_total"
    print(averages.table(sort_by=sort, row_limit=25, max_name_column_width=80))
    print(
        f"step {result['step_ms']:.1f} ms, {result['tokens_per_s']:,.0f} tok/s, "
        f"MFU {100 * result['mfu_vs_peak']:.1f} % of 989 TFLOP/s, "
        f"device busy {100 * result['busy_share']:.0f} % of the step"
    )
    print("| kind | ms per step | share of step |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r['kind']} | {r['ms_per_step']:.1f} | {100 * r['share_of_step']:.1f} % |")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
