"""Generation throughput: `trainer.generation.decode` (what `trainer.generation.generate` runs) against plain
`transformers` `generate`, same target, same prompts, same batches, same run.

    python bench/bench_generate.py --out results/                     # one GPU, a few minutes
    python bench/bench_generate.py --batch-size 64 --max-new-tokens 512 --out g64.json
    python bench/bench_generate.py --smoke --out /tmp/g.json          # tiny, on the CPU

The target is a random Qwen3 at a real shape (default: Qwen3-0.6B's; bf16 on CUDA). Prompts are
random token windows of varied length (`--min-len`…`--max-len`), grouped into batches of similar
length as `trainer.generation.generate` does, and each side decodes every batch greedily up to
`--max-new-tokens`. `--eos-share` picks an end token id so that some answers end early (a random
target rarely stops; real answers vary in length, which is where dropping finished rows pays).
Tokens/s counts answer tokens (up to and including the end token). The first batch of each side
is an untimed warm-up. Both sides' answers are compared token for token: on a GPU in bf16 a
batch of different shape may round differently, so the share of identical answers is reported
rather than asserted.

Then the whole `python -m trainer generate` (prompt JSONL → shards, the model saved and loaded)
runs under torchrun with each `--gpus` process count (default: 1 and every visible GPU): wall
time including start-up, and the decode rate of the ranks together (their answer tokens over the
slowest rank's decode time) — how generation scales with GPUs. `--pipeline-prompts` gives these
runs more prompts than the engine comparison (start-up costs a fixed ~20 s; a scaling figure needs
minutes of decoding). `--gpus 0` skips it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import environment, help_parser, markdown, sync, write  # noqa: E402
from trainer.generation.decode import decode_batch, length_batches  # noqa: E402

# a rank's last line: "generated N samples, T answer tokens in H:MM:SS (R tok/s)"
RATE = re.compile(r"([0-9,]+) answer tokens in [0-9:]+ \(([0-9,.]+) tok/s\)")
SHAPES = {
    "qwen3-0.6b": {"hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 151936},
    "qwen3-1.7b": {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "vocab_size": 151936},
    # bench_eval.py's target (8 layers, hidden 768, its 8,192-token vocabulary)
    "eval-target": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 8,
                    "num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 64,
                    "vocab_size": 8192},
    "smoke": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 512},
}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = help_parser(__doc__)
    p.add_argument(
        "--shape", default="qwen3-0.6b", choices=sorted(SHAPES), help="the random target's shape"
    )
    p.add_argument("--prompts", type=int, default=256, help="prompts of the engine comparison")
    p.add_argument(
        "--pipeline-prompts",
        type=int,
        default=0,
        help="prompts of the trainer.generation.generate runs (0: --prompts; the first --prompts are shared)",
    )
    p.add_argument("--batch-size", type=int, default=32, help="prompts decoded at a time")
    p.add_argument("--min-len", type=int, default=64, help="shortest prompt, tokens")
    p.add_argument("--max-len", type=int, default=512, help="longest prompt, tokens")
    p.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per answer at most")
    p.add_argument("--eos-share", type=float, default=0.3, help="answers expected to end early")
    p.add_argument("--seed", type=int, default=0, help="the prompts' and weights' seed")
    p.add_argument(
        "--gpus",
        default=None,
        help="process counts of the whole-pipeline rows, e.g. 1,8 (default: 1 and all GPUs; "
        "0 skips them)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument(
        "--out", default=None, help="JSON results file, or a folder (then OUT/generate.json)"
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.shape, args.prompts, args.batch_size = "smoke", 6, 3
        args.min_len, args.max_len, args.max_new_tokens = 4, 12, 10
    return args


def build_model(shape: str, device: torch.device, seed: int) -> torch.nn.Module:
    from transformers import Qwen3Config

    from trainer.model.target import load_target

    cfg = Qwen3Config(**SHAPES[shape], max_position_embeddings=8192, tie_word_embeddings=False)
    return load_target(cfg, device=device, seed=seed).model


def random_prompts(args: argparse.Namespace, vocab: int, count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(args.min_len, args.max_len + 1, (count,), generator=gen)
    return [torch.randint(0, vocab, (int(n),), generator=gen).tolist() for n in lengths]


def pick_eos(model: torch.nn.Module, prompts: list[list[int]], args: argparse.Namespace) -> int:
    """An id the model emits in about `eos_share` of a few answers (a greedy pass on a sample)."""
    sample = prompts[: max(1, min(8, len(prompts)))]
    answers = decode_batch(model, sample, max_new_tokens=args.max_new_tokens, eos_ids=(), pad_id=0)
    counts: dict[int, int] = {}
    for a in answers:
        for t in set(a):
            counts[t] = counts.get(t, 0) + 1
    want = args.eos_share * len(sample)
    return min(counts, key=lambda t: (abs(counts[t] - want), t))


def decode_ours(model, rows, args, eos, device) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """`trainer.generation.decode`, as `trainer.generation.generate` calls it."""
    return decode_batch(model, rows, max_new_tokens=args.max_new_tokens, eos_ids={eos}, pad_id=0)


def decode_hf(model, rows, args, eos, device) -> list[list[int]]:  # type: ignore[no-untyped-def]
    """Plain `generate`: left padding, attention mask, greedy, the same end token."""
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows], device=device)
    attn = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
    with torch.no_grad():
        full = model.generate(
            input_ids=ids, attention_mask=attn, do_sample=False,
            max_new_tokens=args.max_new_tokens, eos_token_id=eos, pad_token_id=0,
        )  # fmt: skip
    return [row[: row.index(eos) + 1] if eos in row else row for row in full[:, width:].tolist()]


def run_timed(decode, model, prompts, batches, args, eos, device) -> tuple[list[list[int]], float]:  # type: ignore[no-untyped-def]
    """Answers of every prompt by `decode`, batch by batch, and the seconds of all batches but
    the first (its warm-up)."""
    out: list[list[int]] = [[] for _ in prompts]
    start = 0.0
    for k, batch in enumerate(batches):
        if k == 1:
            sync(device)
            start = time.perf_counter()
        got = decode(model, [prompts[i] for i in batch], args, eos, device)
        for i, a in zip(batch, got, strict=True):
            out[i] = a
    sync(device)
    return out, time.perf_counter() - start


def process_counts(args: argparse.Namespace, device: torch.device) -> list[int]:
    if args.gpus is not None:
        return [int(n) for n in args.gpus.split(",") if int(n) > 0]
    visible = torch.cuda.device_count() if device.type == "cuda" else 1
    return sorted({1, visible})


def pipeline_rows(  # type: ignore[no-untyped-def]
    model, prompts, args, eos, device
) -> list[dict[str, Any]]:
    """The whole `trainer.generation.generate` (prompt file → shards) under torchrun with each process
    count: wall time from start to manifest (model loading included) and the decode rate the
    ranks log (summed)."""
    counts = process_counts(args, device)
    if not counts:
        return []
    with tempfile.TemporaryDirectory(prefix="bench-generate-") as tmp:
        folder = Path(tmp)
        model.generation_config.eos_token_id = eos
        model.save_pretrained(str(folder / "target"))
        with open(folder / "prompts.jsonl", "w") as fh:
            fh.writelines(json.dumps({"input_ids": p}) + "\n" for p in prompts)
        (folder / "gen.toml").write_text(
            f'[model]\ntarget = "{folder / "target"}"\n[data]\npath = "unused"\n'
            f"max_len = {args.max_len + args.max_new_tokens}\n"
            f'[run]\ndevice = "{device.type}"\n'
        )
        return [_pipeline_row(folder, n, len(prompts), args) for n in counts]


def _pipeline_row(
    folder: Path, processes: int, prompts: int, args: argparse.Namespace
) -> dict[str, Any]:
    out = folder / f"out-{processes}"
    # one process: one shard, so its batches are the in-process runs' (same padding, same
    # rounding); several: a few shards per rank
    shard = prompts if processes == 1 else max(args.batch_size, prompts // (4 * processes))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(processes), "-m", "trainer", "generate",
               "--config", str(folder / "gen.toml"), "--prompts", str(folder / "prompts.jsonl"),
               "--out", str(out), "--batch-size", str(args.batch_size),
               "--max-new-tokens", str(args.max_new_tokens), "--shard-size", str(shard),
               "--log-every", "1000"]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(
            f"trainer.generation.generate failed with {processes} processes:\n{done.stderr[-3000:]}"
        )
    counts = json.loads((out / "manifest.json").read_text())["counts"]
    ranks = [(int(n.replace(",", "")), float(r.replace(",", ""))) for n, r in RATE.findall(
        done.stdout + done.stderr)]  # fmt: skip
    return {
        "processes": processes,
        "answer_tokens": counts["answer_tokens"],
        "wall_s": wall,
        "tokens_per_s_wall": counts["answer_tokens"] / wall,
        "tokens_per_s_decode": decode_rate(ranks),
        "rank_decode_s": [round(n / r, 3) if r else None for n, r in ranks],
    }


def decode_rate(ranks: list[tuple[int, float]]) -> float | None:
    """Answer tokens of all ranks over the slowest rank's decode time (each rank logs its tokens
    and tokens/s): a rank that finishes early does not count as if it ran as long as the rest."""
    if not ranks or any(rate <= 0 for _, rate in ranks):
        return None
    return sum(n for n, _ in ranks) / max(n / rate for n, rate in ranks)


def compare_engines(  # type: ignore[no-untyped-def]
    model, prompts: list[list[int]], batches: list[list[int]], args, eos: int, device
) -> tuple[list[dict[str, Any]], float, list[list[int]]]:
    """(a row per engine: answer tokens, seconds, tokens/s; the share of identical answers;
    `trainer.generation.decode`'s answers): plain `generate`, then `trainer.generation.decode`, on the same batches,
    the first batch of each an untimed warm-up."""
    timed = [i for b in batches[1:] for i in b]
    rows: list[dict[str, Any]] = []
    answers = []
    for name, decode in (
        ("transformers generate", decode_hf),
        ("trainer.generation.decode", decode_ours),
    ):
        got, seconds = run_timed(decode, model, prompts, batches, args, eos, device)
        tokens = sum(len(got[i]) for i in timed)
        answers.append(got)
        rows.append({"engine": name, "answer_tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds if seconds else None})  # fmt: skip
    same = sum(answers[0][i] == answers[1][i] for i in timed) / max(len(timed), 1)
    return rows, same, answers[1]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    model = build_model(args.shape, device, args.seed)
    everything = random_prompts(
        args, model.config.vocab_size, max(args.prompts, args.pipeline_prompts)
    )
    prompts = everything[: args.prompts]
    eos = pick_eos(model, prompts, args)
    batches = length_batches([len(p) for p in prompts], args.batch_size)
    rows, same, ours = compare_engines(model, prompts, batches, args, eos, device)
    hf_tps, our_tps = rows[0]["tokens_per_s"], rows[1]["tokens_per_s"]
    summary = {
        "speedup_vs_generate": our_tps / hf_tps if hf_tps and our_tps else None,
        "identical_answers": same,
        "eos_token": eos,
        "ended_early": sum(len(a) < args.max_new_tokens for a in ours),
        # what trainer.generation.generate keeps (answers of ≥ 2 tokens), the warm-up batch included
        "answer_tokens_kept": sum(len(a) for a in ours if len(a) >= 2),
    }
    print(f"generation, {args.shape}, batch {args.batch_size}, {args.prompts} prompts "
          f"of {args.min_len}–{args.max_len} tokens, {args.max_new_tokens} new tokens")  # fmt: skip
    print(markdown(rows, ["engine", "answer_tokens", "seconds", "tokens_per_s"]))
    for key, value in summary.items():
        print(f"- {key}: {value}")
    answered = everything[: args.pipeline_prompts or args.prompts]
    pipeline = pipeline_rows(model, answered, args, eos, device)
    if pipeline:
        print(markdown(pipeline, ["processes", "answer_tokens", "wall_s", "tokens_per_s_wall",
                                  "tokens_per_s_decode"]))  # fmt: skip
        first, last = pipeline[0], pipeline[-1]
        several = len(pipeline) > 1
        summary["pipeline_scaling"] = (
            last["tokens_per_s_decode"] / first["tokens_per_s_decode"]
            if several and first["tokens_per_s_decode"] and last["tokens_per_s_decode"]
            else None
        )
        summary["pipeline_scaling_wall"] = (
            last["tokens_per_s_wall"] / first["tokens_per_s_wall"] if several else None
        )
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    if args.out and (Path(args.out).is_dir() or args.out.endswith("/")):
        Path(args.out).mkdir(parents=True, exist_ok=True)
        args.out = str(Path(args.out) / "generate.json")
    write(
        args.out,
        {
            "settings": settings,
            "env": environment(device),
            "rows": rows,
            "pipeline": pipeline,
            "summary": summary,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
