"""Benchmark of the target/drafter split on two GPUs (1 target + 1 drafter), in one run:

    python bench/bench_pipeline.py --out results.json            # 2 GPUs, a Qwen3-8B-shaped target
    python bench/bench_pipeline.py --smoke --out smoke.json      # CPU, tiny shapes, gloo
    python bench/bench_pipeline.py --attention-kernels flash --out flash.json  # CuTe-DSL attention

1. each role alone (`trainer.commands.plan.measure_rates`): the target forward on GPU 0 → r_target, the
   drafter training step on GPU 1 → r_drafter (tokens/s), and the `plan` prediction for 1 + 1:
   min(r_target, r_drafter);
2. one GPU colocated: target forward then drafter step on GPU 1, tokens/s;
3. the split run (`trainer.split.session.run_split`, two spawned processes, NCCL p2p) → measured tokens/s
   from its metrics rows after the warm-up steps; pipeline efficiency = measured ÷
   min(T·r_target, D·r_drafter);
4. the drafter's model-FLOP utilisation: the model FLOPs of the timed steps' batches (below)
   ÷ their time ÷ 989 TFLOP/s (H200 dense bf16 peak), also against the ~790 TFLOP/s measured
   matmul rate.

Model FLOPs of one drafter train step (`drafter_model_flops`, from the batch itself): the work
the model needs, not what the kernels happen to do, as `bench/flops.py` counts it.
Prints a markdown table and writes the JSON. Targets the 6-minute budget on 2×H200 (compiles
included); all weights are random (no files, no network).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.common import help_parser
from bench.records import write_json

PEAK_BF16 = 989e12
MEASURED_MATMUL = 790e12

FULL = {
    "target": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "seq_len": 4096,
    "num_anchors": 512,
    "drafter_layers": 5,
    "features": 5,  # target layers the drafter reads
    "block_size": 16,
    "samples": 64,
    "warmup": 3,
    "timed": 8,
    "split_steps": 24,
    "split_warmup": 6,
}
SMOKE = {
    "target": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
    ),
    "seq_len": 128,
    "num_anchors": 16,
    "drafter_layers": 2,
    "features": 5,
    "block_size": 8,
    "samples": 16,
    "warmup": 1,
    "timed": 3,
    "split_steps": 6,
    "split_warmup": 2,
}


def add_batch_options(parser: argparse.ArgumentParser) -> None:
    """The drafter's batch: sequences per step, and the parts it trains them in (one optimizer
    step: gradient accumulation spreads the optimizer's fixed cost over more tokens)."""
    parser.add_argument("--batch-size", type=int, default=1, help="data.batch_size (sequences)")
    parser.add_argument(
        "--micro-batches", type=int, default=1, help="data.micro_batches (≤ --batch-size)"
    )


def batch_spec(args: argparse.Namespace) -> dict:
    return {
        "attention_kernels": args.attention_kernels,
        "batch_size": args.batch_size,
        "micro_batches": args.micro_batches,
    }


def target_config(spec: dict):
    from transformers import Qwen3Config

    return Qwen3Config(
        **spec["target"],
        max_position_embeddings=max(8192, 2 * spec["seq_len"]),
        pad_token_id=0,
        tie_word_embeddings=False,
    )


def write_data(path: Path, spec: dict) -> None:
    """Random token sequences of exactly seq_len; the first 1/32 unsupervised (a prompt)."""
    from trainer.data.dataset import Sample, write_samples

    gen = torch.Generator().manual_seed(0)
    n, v = spec["seq_len"], spec["target"]["vocab_size"]
    prompt = n // 32
    samples = [
        Sample(
            torch.randint(1, v, (n,), generator=gen).tolist(),
            [False] * prompt + [True] * (n - prompt),
        )
        for _ in range(spec["samples"])
    ]
    write_samples(path, samples)


def train_config(spec: dict, data: Path, *, device: str, steps: int):
    from trainer.settings.loading import config_from_dict

    return config_from_dict(
        {
            "model": {
                "target": "in-memory",
                "num_layers": spec["drafter_layers"],
                "block_size": spec["block_size"],
            },
            "data": {
                "path": str(data),
                "batch_size": spec.get("batch_size", 1),
                "micro_batches": spec.get("micro_batches", 1),
                "max_len": spec["seq_len"],
                "num_anchors": spec["num_anchors"],
                "bucket": 128 if spec["seq_len"] >= 128 else spec["seq_len"],
                "noise": 0.01,
            },
            "optim": {"lr": 3e-4, "warmup_steps": 2},
            "loss": {"kl_weight": 0.15},
            "run": {
                "steps": steps,
                "device": device,
                "checkpoint_every": 0,
                "log_every": 1,
                "attention_kernels": spec.get("attention_kernels", "auto"),
            },
        }
    )


def make_loader(spec: dict):
    """A `trainer.split.session` target loader building the random target in memory on the device."""

    def loader(config, device):
        from trainer.model.target import load_target

        return load_target(target_config(spec), device=device, num_layers=spec["features"], seed=0)

    return loader


def split_worker(
    local_rank: int, world: int, port: int, spec: dict, data: str, out: str, device: str
) -> None:
    """One rank of the split run (spawned): env as torchrun would set it, then run_split."""
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DFLASH_TARGET_GPUS="1",
    )
    from trainer.split.roles import roles_from_env
    from trainer.split.session import run_split

    cfg = train_config(spec, Path(data), device=device, steps=spec["split_steps"])
    run_split(cfg, out, roles_from_env(), target_loader=make_loader(spec), save_checkpoints=False)


def run_split_procs(
    spec: dict, data: Path, out: Path, *, device: str, world: int = 2
) -> list[dict]:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(split_worker, args=(world, port, spec, str(data), str(out), device), nprocs=world)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def measured_rate(rows: list[dict], warmup: int) -> float:
    """Tokens trained per second between the end of step `warmup` and the last step."""
    rows = sorted(rows, key=lambda r: r["step"])
    timed = [r for r in rows if r["step"] > warmup]
    start = next(r for r in rows if r["step"] == warmup)["time"]
    return sum(r["tokens"] for r in timed) / (timed[-1]["time"] - start)


def drafter_model_flops(spec: dict, batch) -> float:
    """Model FLOPs of one drafter train step on `batch` (a `trainer.data.dataset.Batch`;
    `bench.flops.drafter_step_flops`): the drafter shaped as the benchmark's target, KL on."""
    from types import SimpleNamespace

    from bench.flops import drafter_step_flops

    t = spec["target"]
    shape = SimpleNamespace(
        hidden_size=t["hidden_size"],
        num_heads=t["num_attention_heads"],
        num_kv_heads=t["num_key_value_heads"],
        head_dim=t["head_dim"],
        intermediate_size=t["intermediate_size"],
        vocab_size=t["vocab_size"],
        num_layers=spec["drafter_layers"],
        num_features=spec["features"],
        block_size=spec["block_size"],
        sliding_window=None,
        sliding_layers=(),
        sliding_causal=True,
    )
    return drafter_step_flops(shape, batch, kl=True)


def stream_batches(spec: dict, data: Path, count: int) -> list:
    """The first `count` batches of the benchmark's stream (seed 0): the ones every role trains
    on, in order."""
    from trainer.data.dataset import BatchStream, load_samples

    cfg = train_config(spec, data, device="cpu", steps=1)
    stream = BatchStream(load_samples(data), cfg.data, block_size=spec["block_size"], seed=0)
    return [stream.next_batch() for _ in range(count)]


def mean_model_flops(spec: dict, data: Path, *, skip: int, count: int) -> float:
    """Mean `drafter_model_flops` over batches skip…skip+count−1 of the benchmark's stream (the
    batches the timed steps train on)."""
    batches = stream_batches(spec, data, skip + count)[skip:]
    return sum(drafter_model_flops(spec, batch) for batch in batches) / count


def mask_density(spec: dict, data: Path, device: torch.device) -> float:
    """Non-empty tile share of the BlockMask of a real batch (1.0 on the CPU path)."""
    if device.type != "cuda":
        return 1.0
    from trainer.model.attention import build_draft_mask

    batch = stream_batches(spec, data, 1)[0].to(device)
    mask = build_draft_mask(batch.anchors, batch.valid, spec["seq_len"], spec["block_size"])
    return 1.0 - float(mask.block_mask.sparsity()) / 100.0


def colocated_rate(config, target, device: torch.device, *, warmup: int, timed: int) -> float:
    from trainer.data.dataset import BatchStream, load_samples
    from trainer.run.pipeline import DrafterWorker
    from trainer.run.target_worker import TargetWorker

    stream = BatchStream(
        load_samples(config.data.path), config.data, block_size=config.model.block_size, seed=0
    )
    torch.manual_seed(0)
    worker = DrafterWorker.for_target(target, config, device)
    producer = TargetWorker(target)
    tokens = 0
    for i in range(warmup + timed):
        if i == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
        batch = stream.next_batch()
        worker.train_step(producer.produce(batch), i)  # ends with a host sync (.tolist())
        tokens += batch.num_tokens if i >= warmup else 0
    return tokens / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = help_parser(__doc__)
    parser.add_argument("--out", required=True, help="results JSON")
    parser.add_argument(
        "--smoke", action="store_true", help="CPU, tiny shapes (a check, not a benchmark)"
    )
    parser.add_argument(
        "--attention-kernels",
        default="auto",
        help="run.attention_kernels of the drafter (flash: the CuTe-DSL kernels, flash-attn-4)",
    )
    add_batch_options(parser)
    args = parser.parse_args(argv)
    spec = {**(SMOKE if args.smoke else FULL), **batch_spec(args)}
    if not args.smoke and torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs (use --smoke for a CPU check)", file=sys.stderr)
        return 2
    dev_name = "cpu" if args.smoke else "cuda"
    t0 = time.perf_counter()
    from trainer.commands.plan import measure_rates, predict
    from trainer.model.target import load_target

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        data = tmp / "data.jsonl"
        write_data(data, spec)
        d0 = torch.device("cuda", 0) if not args.smoke else torch.device("cpu")
        d1 = torch.device("cuda", 1) if not args.smoke else torch.device("cpu")
        cfg = train_config(spec, data, device=dev_name, steps=100)
        target = load_target(target_config(spec), device=d0, num_layers=spec["features"], seed=0)
        rates = measure_rates(
            cfg,
            target=target,
            target_device=d0,
            drafter_device=d1,
            warmup=spec["warmup"],
            steps=spec["timed"],
        )
        print(
            f"[{time.perf_counter() - t0:.0f} s] roles alone: target {rates.r_target:,.0f} "
            f"tok/s, drafter {rates.r_drafter:,.0f} tok/s",
            flush=True,
        )
        # Colocated on the drafter's device: its kernels are compiled there already (a compiled
        # kernel recompiles for another device index, which costs minutes cold).
        del target
        target = load_target(target_config(spec), device=d1, num_layers=spec["features"], seed=0)
        colo = colocated_rate(cfg, target, d1, warmup=spec["warmup"] - 1 or 1, timed=spec["timed"])
        print(f"[{time.perf_counter() - t0:.0f} s] colocated: {colo:,.0f} tok/s", flush=True)
        density = mask_density(spec, data, d1)
        flops = mean_model_flops(spec, data, skip=spec["warmup"], count=spec["timed"])
        del target
        if d0.type == "cuda":
            torch.cuda.empty_cache()
        rows = run_split_procs(spec, data, tmp / "split", device=dev_name)
        print(f"[{time.perf_counter() - t0:.0f} s] split run done", flush=True)
        measured = measured_rate(rows, spec["split_warmup"])
    (plan_1_1,) = predict(rates, 2)
    bound = min(rates.r_target, rates.r_drafter)
    achieved = flops / rates.drafter_s_per_batch
    last = rows[-1]
    result = {
        "device": torch.cuda.get_device_name(0) if d0.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "spec": spec,
        "r_target": rates.r_target,
        "r_drafter": rates.r_drafter,
        "target_ms_per_batch": 1e3 * rates.target_s_per_batch,
        "drafter_ms_per_batch": 1e3 * rates.drafter_s_per_batch,
        "split_1_1_tokens_per_s": measured,
        "plan_prediction_1_1": plan_1_1.tokens_per_s,
        "plan_vs_measured": measured / plan_1_1.tokens_per_s,
        "pipeline_efficiency": measured / bound,
        "colocated_tokens_per_s": colo,
        "mask_density": density,
        "drafter_model_flops_per_step": flops,
        "compiled_layers": cfg.run.compiles_on(d1),
        "drafter_tflops": achieved / 1e12,
        "drafter_mfu_vs_peak": achieved / PEAK_BF16,
        "drafter_mfu_vs_matmul": achieved / MEASURED_MATMUL,
        "split_last_row": {k: last[k] for k in ("roles", "in_flight", "batches", "ranks")},
        "rates": asdict(rates),
        "wall_s": time.perf_counter() - t0,
    }
    write_json(args.out, result)
    print(table(result))
    return 0


def table(r: dict) -> str:
    rows = [
        ("target alone (r_target), tok/s", f"{r['r_target']:,.0f}"),
        ("drafter alone (r_drafter), tok/s", f"{r['r_drafter']:,.0f}"),
        ("1 + 1 split measured, tok/s", f"{r['split_1_1_tokens_per_s']:,.0f}"),
        ("plan prediction min(r_target, r_drafter), tok/s", f"{r['plan_prediction_1_1']:,.0f}"),
        ("pipeline efficiency (measured ÷ prediction)", f"{r['pipeline_efficiency']:.3f}"),
        ("one device colocated, tok/s", f"{r['colocated_tokens_per_s']:,.0f}"),
        ("drafter TFLOP/s", f"{r['drafter_tflops']:.1f}"),
        ("drafter MFU vs 989 TFLOP/s peak", f"{100 * r['drafter_mfu_vs_peak']:.1f} %"),
        ("drafter MFU vs 790 TFLOP/s measured matmul", f"{100 * r['drafter_mfu_vs_matmul']:.1f} %"),
        ("BlockMask density", f"{r['mask_density']:.3f}"),
        ("drafter attention kernels (run.attention_kernels)", r["spec"]["attention_kernels"]),
        ("wall time of the benchmark, s", f"{r['wall_s']:.0f}"),
    ]
    lines = [f"| metric ({r['device']}, torch {r['torch']}) | value |", "| --- | --- |"]
    lines += [f"| {a} | {b} |" for a, b in rows]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
