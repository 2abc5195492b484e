"""Where one drafter training step spends its GPU time, at the two-GPU benchmark's shapes.

    python bench/profile_drafter.py [--steps 2] [--compile on|off] [--out profile.json]  # one GPU
    python bench/profile_drafter.py --attention-kernels flash     # FlexAttention's CuTe-DSL kernels
    python bench/profile_drafter.py --smoke                                             # CPU

Same model, data and settings as `bench_pipeline.py` (Qwen3-8B-shaped random target, 5-layer
drafter, 4,096 tokens, 512 anchors): the target produces the features once, then the drafter's
`train_step` runs a few times untimed (compiles) and `--steps` times under the profiler. Prints
the kernels sorted by GPU time and a summary by kind — attention forward and backward
(FlexAttention on a GPU), the BlockMask, matrix multiplies, the loss's kernels, the optimizer,
the rest — with each kind's share of the step, the step's wall time and the drafter MFU it
implies (model FLOPs as `bench_pipeline.drafter_model_flops` counts them), so that the distance
to the MFU goal can be attributed before it is worked on. `--compile on|off` picks whether the
drafter's layers are compiled (`run.compile`; default: on a GPU); dynamo's graph breaks are
reported, since one inside a layer splits its fused graph.
"""

from __future__ import annotations

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
    add_batch_options,
    batch_spec,
    drafter_model_flops,
    stream_batches,
    target_config,
    train_config,
    write_data,
)
from bench.common import help_parser
from bench.records import write_json
from trainer.run.profiling import by_kind, kernel_times
from trainer.settings.config import ATTENTION_KERNELS


def _seconds_per_step(worker, features: list, steps: range, device: torch.device) -> float:
    """Wall time per drafter step over `steps` (each ends with a host sync: `.tolist()`)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for i in steps:
        worker.train_step(features[i], i)
    return (time.perf_counter() - start) / len(steps)


def main(argv: list[str] | None = None) -> int:
    parser = help_parser(__doc__)
    parser.add_argument("--steps", type=int, default=2, help="profiled drafter steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles)")
    parser.add_argument("--out", default=None, help="also write the summary as JSON")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (a check)")
    parser.add_argument(
        "--compile", choices=("auto", "on", "off"), default="auto", help="compile the layers"
    )
    parser.add_argument(
        "--attention-kernels",
        choices=ATTENTION_KERNELS,
        default="auto",
        help="run.attention_kernels: the flex kernel preset (flash needs flash-attn-4)",
    )
    add_batch_options(parser)
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("needs a CUDA GPU (use --smoke for a CPU check)", file=sys.stderr)
        return 2
    spec = {**(SMOKE if args.smoke else FULL), **batch_spec(args)}
    device = torch.device("cpu" if args.smoke else "cuda")

    from torch._dynamo.utils import counters

    from trainer.model.target import load_target
    from trainer.run.pipeline import DrafterWorker
    from trainer.run.target_worker import TargetWorker
    from trainer.settings.loading import with_overrides

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data.jsonl"
        write_data(data, spec)
        cfg = train_config(spec, data, device=device.type, steps=100)
        if args.compile != "auto":
            cfg = with_overrides(cfg, run={"compile": args.compile == "on"})
        target = load_target(
            target_config(spec), device=device, num_layers=spec["features"], seed=0
        )
        producer = TargetWorker(target)
        n = args.warmup + 2 * args.steps
        batches = [b.to(device) for b in stream_batches(spec, data, n)]
        features = [producer.produce(batch) for batch in batches]
    timed = range(args.warmup, args.warmup + args.steps)
    flops = sum(drafter_model_flops(spec, batches[i]) for i in timed) / args.steps
    counters.clear()
    torch.manual_seed(0)
    worker = DrafterWorker.for_target(target, cfg, device)
    for i in range(args.warmup):
        worker.train_step(features[i], i)
    gpu = device.type == "cuda"
    step_s = _seconds_per_step(worker, features, timed, device)
    profiled = range(args.warmup + args.steps, n)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if gpu:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        profiled_s = _seconds_per_step(worker, features, profiled, device)
    averages = prof.key_averages()
    events = [(key, us / args.steps) for key, us in kernel_times(averages, gpu=gpu)]
    kernel_us = sum(us for _, us in events)
    rows = by_kind(events, kernel_us)
    result = {
        "device": torch.cuda.get_device_name(0) if gpu else "cpu",
        "torch": torch.__version__,
        "compiled_layers": worker.compiled,
        "attention_kernels": args.attention_kernels,
        "batch_size": args.batch_size,
        "micro_batches": args.micro_batches,
        "graph_breaks": dict(counters["graph_break"]),
        "model_flops_per_step": flops,
        "step_ms": step_s * 1e3,
        "tokens_per_s": spec["seq_len"] * args.batch_size / step_s,
        "mfu_vs_peak": flops / step_s / PEAK_BF16,
        "kernel_ms_per_step": kernel_us / 1e3,
        "profiled_step_ms": profiled_s * 1e3,
        "kinds": rows,
    }
    sort = "cuda_time_total" if gpu else "self_cpu_time_total"
    print(averages.table(sort_by=sort, row_limit=25, max_name_column_width=80))
    print(
        f"step {result['step_ms']:.1f} ms (unprofiled), {result['tokens_per_s']:,.0f} tok/s, "
        f"MFU {100 * result['mfu_vs_peak']:.1f} % of 989 TFLOP/s; kernels "
        f"{result['kernel_ms_per_step']:.1f} ms per step (profiled step "
        f"{result['profiled_step_ms']:.1f} ms); layers compiled: {result['compiled_layers']}, "
        f"graph breaks: {result['graph_breaks']}"
    )
    print("| kind | ms per step | share of kernel time |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r['kind']} | {r['ms_per_step']:.1f} | {100 * r['share']:.1f} % |")
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
