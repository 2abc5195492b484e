"""What a trained drafter is worth: τ by real speculative decoding, held out and on its own
training prompts, beside prompt lookup on the same target and prompts.

    python bench/bench_eval.py                            # one H200; writes bench/results/eval/eval.json
    python bench/bench_eval.py --samples 65536 --drafter-steps 1600 --out eval.json  # one point
    python bench/bench_eval.py --reuse-target --train-data DIR,DIR2   # data made elsewhere
    python bench/bench_eval.py --gen-temperatures 0,0.8 --prepare-only # target + data, then stop
    python bench/bench_eval.py --smoke --out /tmp/e.json  # tiny, CPU, checks the path
    python bench/bench_eval.py --demo-cpu --out demo.json # the demo drafter (trainer/configs/demo.toml)

GPU run, in order:
1. corpus: the `.py` sources of Python's standard library (they ship with every Python), split by
   file: every `--holdout-every`-th file is held out (never trained on, by the target or the
   drafter) and gives the evaluation prompts; `--unseen-every K` (4 by default) keeps every K-th
   of the others from the target too, so that the drafter's prompts come from code the target
   answers as it answers the held-out files, not by reciting what it memorised (a reused target
   keeps the split it was trained with, saved beside it); `--unseen-past-cap BYTES` adds files
   past `--corpus-bytes` to the kept ones, then installed packages' sources where the standard
   library ends first (more distinct code for the drafter's prompts, the target's files and the
   held-out ones unchanged, package files that repeat held-out code left out: `eval_corpus.py`);
2. a byte-level BPE tokenizer trained on the corpus with `tokenizers` (`eval_target.py`);
3. a Qwen3-shaped target (8 layers, hidden 768) trained from scratch for a fixed number of steps
   (`--target-steps`) on the training files, so that its greedy continuations are code-like
   rather than random, saved with `save_pretrained` (`--reuse-target`: the one a previous run
   saved in `--work`; `eval_target.py`);
4. training data (`training_samples`, the one function that picks the source): `trainer.generation.generate`
   (what users run) answers windows of the files kept from the target (`--drafter-prompts
   target-files`: of its training files) with the saved target, once per `--gen-temperatures`
   entry (by default 16 tokens sampled at temperature 1, then the greedy answer: `--gen-sampled-
   prefix`; 0 is greedy from the start; several sets are interleaved), into token shards
   supervised on the answers; or `--train-data`, data made with the same target; then plain
   `transformers` `generate` against `trainer.generation.decode` on the first `--gen-compare` prompts with
   the same target and batch size (`generation` in the JSON, beside each `trainer.generation.generate`
   run's own rate); `--prepare-only` stops here (`bench/compare_recipes.py` then trains several
   recipes on it);
5. prompt lookup (n-gram drafting, n = `--lookup-max-n`…1) on the held-out prompts, once (the
   target is fixed), with the target in fp32 (so that the lossless check is not at the mercy of
   bf16 rounding between forwards of different lengths);
6. each point's steps: by default 3 epochs of its samples and at least 600 (600, 600 and 6,144
   for the default 2,048, 20,480 and 262,144 samples; fewer where the windows drawn hold fewer
   distinct prompts), the same on every GPU; `--drafter-steps`
   gives one count for all points or one per point; with `--drafter-steps 0`, as many as fit
   `--drafter-seconds`, from the step time of a short run of the same drafter;
7. for each data size of `--samples` (a "point"): a drafter trained for those steps on
   the first N samples with the project's trainer (`trainer.run.trainer`, its τ probe logging held-out
   and training-prompt τ), then `trainer.evaluation.evaluate` on the held-out prompts and on prompts of
   its training samples, and on the held-out prompts again from the folder `trainer.export.folder`
   writes (`exported.tau`: the drafter as an engine loads it, in `--export-dtype`); reported per
   point: `held_out.tau`, `exported.tau`, `baselines.prompt_lookup.tau`, `train_prompts.tau`,
   `samples` and `epochs` (samples seen / samples). The largest point's
   fields are also at the top level of the JSON, every point under `points`.

`--demo-cpu` trains the demo drafter with its default config (skipped when its run folder already
holds the final checkpoint) and evaluates it on fresh random prompts (held out: the demo data are
continuations of other random prompts), with prompt lookup beside it, and on the prompts of its
own training samples.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import shutil
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import help_parser, log  # noqa: E402
from bench.eval_corpus import corpus  # noqa: E402
from bench.eval_target import (  # noqa: E402
    encode,
    saved_split,
    target_and_tokenizer,
    windows,
)
from bench.records import compact_json, write_json  # noqa: E402
from trainer.data.dataset import Sample, load_samples, write_samples  # noqa: E402
from trainer.data.eval_prompts import prompt_of_sample  # noqa: E402
from trainer.data.shards import ShardSamples  # noqa: E402
from trainer.evaluation.drafters import BlockDrafter, DFlashDrafter  # noqa: E402
from trainer.evaluation.evaluate import load_drafter  # noqa: E402
from trainer.evaluation.lossless import LosslessViolation  # noqa: E402
from trainer.evaluation.prompt_lookup import PromptLookupDrafter  # noqa: E402
from trainer.evaluation.report import evaluate  # noqa: E402
from trainer.evaluation.speculative import greedy_outputs  # noqa: E402
from trainer.export.hf_format import DTYPES  # noqa: E402
from trainer.model.target import Target, load_target  # noqa: E402
from trainer.run.probe import spread  # noqa: E402
from trainer.settings.config import LossConfig, TrainConfigError  # noqa: E402
from trainer.settings.loading import (  # noqa: E402
    add_overrides_option,
    config_from_dict,
    load_config,
)

RESULTS = ROOT / "bench" / "results" / "eval" / "eval.json"


def write_prompts(path: Path, prompts: torch.Tensor) -> None:
    """Prompt-only samples in the tokenized format (nothing supervised: all of it is prompt)."""
    write_samples(path, [Sample(p.tolist(), [False] * len(p)) for p in prompts])


# ---- training data -------------------------------------------------------------------------------


def training_samples(
    args: argparse.Namespace, stream: torch.Tensor | None, device: torch.device
) -> tuple[Any, list[dict[str, Any]]]:
    """(the drafter's training data, one row per `trainer.generation.generate` run: samples, answer tokens,
    seconds, tokens/s) — the one place to swap the source. `--train-data` (`stream` None): files
    or folders `trainer.data.dataset.load_samples` reads, made with this benchmark's target
    (`--reuse-target`); otherwise `trainer.generation.generate` (the command users run) answers random
    windows of `stream` (the files of `--drafter-prompts`) with the saved target, once per
    `--gen-temperatures` entry (0: greedy), into token shards. Several sources are interleaved,
    so that the first N samples of every point hold each source in equal parts."""
    if stream is None:
        max_len = args.prompt_len + args.gen_len
        given = [load_samples(path, max_len=max_len) for path in args.train_data]
        return interleave(given), []
    work = Path(args.work)
    prompts = work / "generate-prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"input_ids": w.tolist()}) + "\n"
            for w in windows(stream, max(args.samples), args.prompt_len, seed=2)
        )
    )
    config = work / "generate.toml"
    config.write_text(
        f'[model]\ntarget = "{work / "target"}"\n'
        f"[data]\nmax_len = {args.prompt_len + args.gen_len}\n"
        f'[run]\ndevice = "{device.type}"\nthreads = {1 if args.smoke else 0}\n'
    )
    runs = [generated(args, config, prompts, temperature) for temperature in args.gen_temperatures]
    return interleave([samples for samples, _ in runs]), [row for _, row in runs]


def generated(
    args: argparse.Namespace, config: Path, prompts: Path, temperature: float
) -> tuple[Any, dict[str, Any]]:
    """The target's answers to `prompts` at `temperature` (0: greedy; with
    `--gen-sampled-prefix N`, only N tokens sampled, then the greedy answer), made by
    `trainer.generation.generate` into `--work/<generated_name>`, and the run's rate (the whole command:
    model load and start-up included)."""
    from trainer.data.shards import MANIFEST
    from trainer.generation.generate import main as generate

    name = generated_name(temperature, args.gen_sampled_prefix, args.drafter_prompts)
    out = Path(args.work) / name
    shutil.rmtree(out, ignore_errors=True)  # the target was trained anew: its answers are too
    sampling = ["--temperature", str(temperature), "--seed", "1"] if temperature else []
    if temperature and args.gen_sampled_prefix:
        sampling += ["--sampled-prefix", str(args.gen_sampled_prefix)]
    t0 = time.perf_counter()
    code = generate(
        [
            "--config", str(config), "--prompts", str(prompts), "--out", str(out),
            "--max-new-tokens", str(args.gen_len), "--batch-size", str(args.gen_batch),
            "--shard-size", "4096", "--log-every", "30", *sampling,
        ]
    )  # fmt: skip
    if code != 0:
        raise SystemExit(f"trainer.generation.generate failed with exit code {code}")
    seconds = time.perf_counter() - t0
    counts = json.loads((out / MANIFEST).read_text())["counts"]
    row = {"data": name, "samples": counts["samples"], "answer_tokens": counts["answer_tokens"]}
    row |= {"seconds": seconds, "tokens_per_s": counts["answer_tokens"] / seconds}
    return load_samples(out), row


def generation_speed(
    args: argparse.Namespace, work: Path, device: torch.device, tokenizer: Any
) -> dict[str, Any] | None:
    """Plain `transformers` `generate` against `trainer.generation.decode` (what `trainer.generation.generate` runs)
    on this run's target as `trainer.generation.generate` loads it (bf16 on a GPU), the first
    `--gen-compare` of its prompts, greedy, `--gen-len` new tokens, batches of `--gen-batch`
    (the first batch of each side a warm-up), in the run that makes the data. None when no data
    were generated here or `--gen-compare 0`."""
    if not args.gen_compare or not (work / "generate-prompts.jsonl").is_file():
        return None
    from bench.bench_generate import compare_engines
    from trainer.generation.decode import end_tokens, length_batches

    with (work / "generate-prompts.jsonl").open() as lines:
        first = itertools.islice(lines, args.gen_compare)
        prompts = [json.loads(line)["input_ids"] for line in first]
    model = load_target(work / "target", device=device).model
    (eos,) = end_tokens(model, tokenizer)  # the benchmark's target has one end token
    batches = length_batches([len(p) for p in prompts], args.gen_batch)
    if len(batches) < 2:
        log(f"generation speed not compared: {len(prompts)} prompts make one batch, the warm-up")
        return None
    settings = argparse.Namespace(max_new_tokens=args.gen_len)
    rows, same, _ = compare_engines(model, prompts, batches, settings, eos, device)
    del model
    hf, ours = (row["tokens_per_s"] for row in rows)
    log(
        f"generation, batch {args.gen_batch}: transformers generate {hf or 0:,.0f} tok/s, "
        f"trainer.generation.decode {ours or 0:,.0f} tok/s, {100 * same:.0f} % identical answers"
    )
    return {
        "prompts": len(prompts), "timed_prompts": len(prompts) - len(batches[0]),
        "batch_size": args.gen_batch, "max_new_tokens": args.gen_len, "rows": rows,
        "identical_answers": same,
        "speedup_vs_generate": ours / hf if hf and ours else None,
    }  # fmt: skip


def generated_name(temperature: float, sampled_prefix: int, prompts: str = "target-files") -> str:
    """`generated` (greedy), `generated-t0.8` (sampled), `generated-t1-p16` (16 tokens sampled
    at 1, then greedy); `generated-unseen…` for answers to the files kept from the target."""
    name = "generated-unseen" if prompts == "unseen-files" else "generated"
    if temperature == 0:
        return name
    return f"{name}-t{temperature:g}" + (f"-p{sampled_prefix}" if sampled_prefix else "")


def interleave(sources: list[Any]) -> Any:
    """One source as it is; several → a list taking one sample from each in turn (the longer
    ones' tails last)."""
    if len(sources) == 1:
        return sources[0]
    longest = max(len(s) for s in sources)
    return [s[i] for i in range(longest) for s in sources if i < len(s)]


# ---- evaluation ----------------------------------------------------------------------------------


def fp32_target(folder: Path, device: torch.device, model: Any) -> Target:
    """The saved (fp32) weights in fp32, with the feature layers the trainer picks from the
    `model` settings: the same target that generated the data, and argmax ties between
    forwards of different lengths far rarer than in bf16."""
    target = load_target(folder, layers=model.target_layers, num_layers=model.num_target_layers)
    target.model.to(device)
    return target


def measure(
    target: Target,
    block: BlockDrafter,
    prompts: list[list[int]],
    max_new: int,
    *,
    expected: list[list[int]] | None = None,
) -> dict[str, Any]:
    """`evaluate` with the lossless check (against `expected` when given); a violation is
    recorded, then τ is measured without the check."""
    start = time.perf_counter()
    try:
        report = evaluate(target, block, prompts, max_new_tokens=max_new, expected=expected)
        violation = None
    except LosslessViolation as exc:
        violation = str(exc)
        log(f"lossless check: {violation}; τ measured again without the check")
        report = evaluate(target, block, prompts, max_new_tokens=max_new, check_lossless=False)
    row = asdict(report)
    row["lossless"] = violation is None
    row["lossless_violation"] = violation
    row["seconds"] = time.perf_counter() - start
    log(report.summary())
    return row


def trained_block(target: Target, drafter: Any) -> DFlashDrafter:
    return DFlashDrafter(
        drafter, embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight
    )


def run_eval(
    target: Target, drafter: Any, prompts: list[list[int]], max_new: int
) -> dict[str, Any]:
    return measure(target, trained_block(target, drafter), prompts, max_new)


def lookup_baseline(
    target: Target, prompts: list[list[int]], args: argparse.Namespace, expected: list[list[int]]
) -> dict[str, Any]:
    """Prompt lookup's τ on `prompts` (the same for every drafter point: the target is fixed)."""
    drafter = PromptLookupDrafter(args.block_size, max_n=args.lookup_max_n)
    log(f"{drafter.describe()}:")
    row = measure(target, drafter, prompts, args.max_new_tokens, expected=expected)
    return {**row, "max_n": args.lookup_max_n, "min_n": 1}


# ---- the GPU run -----------------------------------------------------------------------------------


def drafter_config(
    args: argparse.Namespace, work: Path, data: Path, device: torch.device, steps: int = 1
) -> Any:
    """The drafter's training settings for `steps` steps on `data` (probe every steps/4), then
    `--set` overrides."""
    return config_from_dict(
        {
            "model": {
                "target": str(work / "target"),
                "num_layers": args.drafter_layers,
                "block_size": args.block_size,
                "target_layers": args.feature_layers,
            },
            "data": {
                "path": str(data),
                "batch_size": args.drafter_batch,
                "max_len": args.prompt_len + args.gen_len,
                "num_anchors": args.anchors,
                "bucket": 128 if device.type == "cuda" else 32,
                "noise": 0.02,
            },
            "optim": {"lr": args.drafter_lr, "warmup_steps": max(1, steps // 20)},
            "loss": {"kl_weight": args.kl_weight},
            "run": {
                "steps": steps,
                "device": device.type,
                "checkpoint_every": 0,
                "log_every": max(1, steps // 20),
                "threads": 1 if args.smoke else 0,
            },
            "eval": {
                "every": max(1, steps // 4),
                "prompts": str(work / "prompts.jsonl"),
                "num_prompts": 4,
                "train_prompts": 4,
                "max_new_tokens": min(32, args.max_new_tokens),
                "lookup_max_n": args.lookup_max_n,
            },
        },
        args.overrides,
    )


def point_data(work: Path, samples: Sequence[Sample]) -> Path:
    """Where a point's trainer reads its samples: all of one `trainer.generation.generate` run → its shard
    folder itself, memory-mapped as a user's run reads it (nothing copied: at hundreds of
    thousands of samples a copy costs minutes and gigabytes); else `work/train-<n>.jsonl`."""
    if isinstance(samples, ShardSamples) and samples.whole:
        return samples.source.folder
    data = work / f"train-{len(samples)}.jsonl"
    write_samples(data, samples)
    return data


def drafter_point(
    args: argparse.Namespace,
    samples: list[Sample],
    held: dict[str, Any],
    device: torch.device,
    steps: int,
) -> dict[str, Any]:
    """Train a drafter on `samples` for `steps` steps and measure it: held-out τ,
    training-prompt τ, epochs."""
    from trainer.run.trainer import Trainer

    work = Path(args.work)
    data = point_data(work, samples)
    run_dir = work / f"run-{len(samples)}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a previous run's checkpoint would be resumed
    t0 = time.perf_counter()
    config = drafter_config(args, work, data, device, steps)
    trainer = Trainer(config, run_dir, emit=log)
    results = trainer.run()
    train_s = time.perf_counter() - t0
    trained = trainer.source.stream.samples
    tail = results[-max(1, len(results) // 10) :]
    train_acc = [sum(a) / len(a) for a in zip(*(r.slot_accuracy for r in tail), strict=True)]
    drafter = trainer.drafter_worker.drafter.float()
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()

    t0 = time.perf_counter()
    target = held["target"]
    block = trained_block(target, drafter)
    log(f"{len(trained)} samples, held out:")
    held_out = measure(
        target, block, held["prompts"], args.max_new_tokens, expected=held["expected"]
    )
    log(f"{len(trained)} samples, training prompts:")
    seen = measure(target, block, spread(trained, args.eval_prompts), args.max_new_tokens)
    log(f"{len(trained)} samples, exported ({args.export_dtype}), held out:")
    exported = exported_tau(args, config, run_dir, held)
    return {
        "samples": len(trained),
        "epochs": steps * config.data.batch_size / len(trained),
        "held_out": held_out,
        "exported": exported,
        "baselines": {"prompt_lookup": held["prompt_lookup"]},
        "train_prompts": seen,
        "drafter": {
            "steps": steps,
            "layers": config.model.num_layers,  # as trained: `--set` may override the options
            "block_size": config.model.block_size,
            "final_loss": results[-1].loss,
            "train_slot_accuracy": train_acc,
            "train_s": train_s,
            "eval_s": time.perf_counter() - t0,
        },
    }


def exported_tau(
    args: argparse.Namespace, config: Any, run_dir: Path, held: dict[str, Any]
) -> dict[str, Any]:
    """The drafter as an engine gets it: the final checkpoint exported by `trainer.export.folder` in
    `--export-dtype`, read back from that folder alone (`trainer.export.hf_format.load_folder`), its τ
    on the held-out prompts. Beside `held_out` it shows what export and rounding cost."""
    from trainer.export.folder import export
    from trainer.export.hf_format import load_folder, read_config

    out = run_dir.parent / f"{run_dir.name}-export"
    shutil.rmtree(out, ignore_errors=True)  # the previous run's folder: export refuses to overwrite
    folder = export(config, run_dir, out, dtype=args.export_dtype)
    target = held["target"]
    layers = list(read_config(folder)["dflash_config"]["target_layer_ids"])
    if layers != target.layers:
        raise SystemExit(f"{folder} reads target layers {layers}, the target {target.layers}")
    drafter, _ = load_folder(folder, device=target.device)  # fp32, like the evaluated drafter
    block = trained_block(target, drafter)
    row = measure(target, block, held["prompts"], args.max_new_tokens, expected=held["expected"])
    return {**row, "folder": str(folder), "dtype": args.export_dtype}


def point_plan(args: argparse.Namespace, available: int) -> dict[int, int]:
    """{samples: steps} of every point, smallest first; a count past the `available` samples
    becomes all of them. Steps: `--drafter-steps` (one count for all points, or one per point in
    the order of the sorted `--samples`), by default `DEFAULT_EPOCHS` over the point's samples
    and at least `MIN_STEPS`; 0: from `--drafter-seconds` (filled in by `drafter_steps`)."""
    given = args.drafter_steps
    plan: dict[int, int] = {}
    for i, requested in enumerate(args.samples):
        n = min(requested, available)
        if given is None:
            plan[n] = max(MIN_STEPS, math.ceil(DEFAULT_EPOCHS * n / args.drafter_batch))
        else:
            plan[n] = given[0] if len(given) == 1 else given[i]
    return plan


def drafter_steps(
    args: argparse.Namespace, samples: list[Sample], device: torch.device
) -> tuple[dict[int, int], float | None]:
    """({samples: steps} of every point, seconds per step): `point_plan`'s steps; with
    `--drafter-steps 0`, as many as fit `--drafter-seconds`, from the steady-state step time of
    a short run of the same drafter on the same data (which also compiles what every point then
    reuses)."""
    plan = point_plan(args, len(samples))
    if all(plan.values()):
        return plan, None
    from trainer.run.trainer import Trainer

    work = Path(args.work)
    data = work / "train-calibrate.jsonl"
    write_samples(data, samples[: 64 * args.drafter_batch])
    run_dir = work / "run-calibrate"
    shutil.rmtree(run_dir, ignore_errors=True)
    warm, timed = (2, 3) if args.smoke else (15, 30)
    config = drafter_config(args, work, data, device, steps=warm + timed)
    trainer = Trainer(replace(config, eval=replace(config.eval, every=0)), run_dir, emit=log)
    trainer.run(until=warm)
    t0 = time.perf_counter()
    trainer.run(until=warm + timed)
    step_s = (time.perf_counter() - t0) / timed
    del trainer
    shutil.rmtree(run_dir, ignore_errors=True)
    steps = max(1, int(args.drafter_seconds / step_s))
    log(
        f"drafter step {1e3 * step_s:.1f} ms: {steps} steps per point ({args.drafter_seconds:.0f} s)"
    )
    return dict.fromkeys(plan, steps), step_s


DEFAULT_UNSEEN_EVERY = 4  # kept files' answers carry over: bench/results/prompt-sources-h200
DEFAULT_EPOCHS = 3  # a point's default steps: 3 passes over its samples…
MIN_STEPS = 600  # …and at least this many (the 2,048-sample point memorises: 37 epochs)


def resolve_split(args: argparse.Namespace) -> None:
    """Fill the split options left unset: a reused target's own `--unseen-every`, else
    `DEFAULT_UNSEEN_EVERY`; the drafter's prompts from the kept files where there are any. With
    `--train-data` the prompts are the data's, recorded only when given."""
    saved = saved_split(Path(args.work) / "target") if args.reuse_target else None
    if args.unseen_every is None:
        args.unseen_every = DEFAULT_UNSEEN_EVERY if saved is None else saved["unseen_every"]
    if args.drafter_prompts is None and not args.train_data:
        kept = args.unseen_every or args.unseen_past_cap
        args.drafter_prompts = "unseen-files" if kept else "target-files"


def gpu_run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    texts = corpus(args.corpus_bytes, args.holdout_every, args.unseen_every, args.unseen_past_cap)
    log(texts.describe(args.corpus_bytes, args.unseen_past_cap))
    tokenizer, target_info = target_and_tokenizer(args, texts.train, device)
    held_stream = encode(tokenizer, texts.held)
    prompt_stream = None  # given data (--train-data) need no prompts
    source = f"the drafter's data from {', '.join(args.train_data or [])}"
    if not args.train_data:
        files = texts.unseen if args.drafter_prompts == "unseen-files" else texts.train
        prompt_stream = encode(tokenizer, files)
        tokens = len(prompt_stream)
        source = f"the drafter's prompts from {tokens:,} tokens of the {args.drafter_prompts}"
    log(f"tokens: {len(held_stream):,} held out; {source}")
    timings = {"target_s": time.perf_counter() - t0}

    t0 = time.perf_counter()
    samples, generate_runs = training_samples(args, prompt_stream, device)
    eval_prompts = windows(held_stream, args.eval_prompts, args.prompt_len, seed=3)
    write_prompts(work / "prompts.jsonl", eval_prompts)
    timings["data_s"] = time.perf_counter() - t0
    log(f"training data: {len(samples):,} samples")
    generation = None
    if generate_runs:
        t0 = time.perf_counter()
        speed = generation_speed(args, work, device, tokenizer)
        generation = {"trainer_generate": generate_runs, "engines": speed}
        timings["generation_compare_s"] = time.perf_counter() - t0
    if args.prepare_only:
        return {
            "mode": "prepare",
            "target": target_info,
            "samples": len(samples),
            "generation": generation,
            "timings_s": timings,
        }

    t0 = time.perf_counter()
    plan, step_s = drafter_steps(args, samples, device)
    timings["calibrate_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    target = fp32_target(work / "target", device, drafter_config(args, work, work, device).model)
    prompts = eval_prompts.tolist()
    expected = greedy_outputs(target, prompts, args.max_new_tokens)
    held = {"target": target, "prompts": prompts, "expected": expected}
    held["prompt_lookup"] = lookup_baseline(target, prompts, args, expected)
    timings["baseline_s"] = time.perf_counter() - t0

    result: dict[str, Any] = {
        "mode": "smoke" if args.smoke else "gpu",
        "target": target_info,
        "training_data": ", ".join(args.train_data or [])
        or f"trainer.generation.generate: answers to windows of the {args.drafter_prompts} at temperatures "
        + ", ".join(f"{t:g}" for t in args.gen_temperatures)
        + (f" (sampled prefix {args.gen_sampled_prefix})" if args.gen_sampled_prefix else ""),
        "recipe": recipe(args),
        "generation": generation,
        "baselines": {"prompt_lookup": held["prompt_lookup"]},
        "points": [],
        "drafter_step_s": step_s,
        "timings_s": timings,
    }
    for n, steps in plan.items():
        save_partial(args, result)  # a run cut short still leaves what it measured
        result["points"].append(drafter_point(args, samples[:n], held, device, steps))
    last = result["points"][-1]
    # the largest point's figures at the top level; every point under `points`
    for key in (
        "samples",
        "epochs",
        "held_out",
        "exported",
        "baselines",
        "train_prompts",
        "drafter",
    ):
        result[key] = last[key]
    return result


def recipe(args: argparse.Namespace) -> dict[str, Any]:
    """The drafter's recipe as run, for telling runs apart. With `--train-data` the generation
    settings are the given data's, unknown here: null rather than this run's unused defaults."""
    keys = (
        "drafter_layers", "block_size", "drafter_batch", "anchors", "drafter_lr", "kl_weight",
        "feature_layers", "gen_temperatures", "gen_sampled_prefix", "overrides",
        "unseen_every", "unseen_past_cap", "drafter_prompts",
    )  # fmt: skip
    given = ("gen_temperatures", "gen_sampled_prefix") if args.train_data else ()
    return {key: None if key in given else getattr(args, key) for key in keys}


def save_partial(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The results so far, marked incomplete (the finished run overwrites them)."""
    if args.out:
        write_json(args.out, {**result, "complete": False})


def demo_cpu(args: argparse.Namespace) -> dict[str, Any]:
    """The demo drafter after its default run (trained into `<work>/run` unless its final
    checkpoint is already there), evaluated on held-out and on training prompts."""
    from trainer.run.trainer import Trainer, resolve_demo

    run_dir = Path(args.work) / "run"
    config = resolve_demo(load_config(ROOT / "trainer" / "configs" / "demo.toml"), run_dir)
    t0 = time.perf_counter()
    if not (run_dir / f"step-{config.run.steps:08d}" / "manifest.json").is_file():
        Trainer(config, run_dir, emit=log).run()
    train_s = time.perf_counter() - t0
    torch.set_num_threads(config.run.threads or torch.get_num_threads())
    target = load_target(
        config.model.target,
        layers=config.model.target_layers,
        num_layers=config.model.num_target_layers,
    )
    drafter, step = load_drafter(config, run_dir, target)
    demo = config.demo
    gen = torch.Generator().manual_seed(10_000 + demo.seed)  # the demo data use seed + 1
    held = torch.randint(0, 256, (args.eval_prompts, demo.prompt_len), generator=gen).tolist()
    seen = [prompt_of_sample(s) for s in load_samples(config.data.path)][: args.eval_prompts]
    lookup = PromptLookupDrafter(config.model.block_size, max_n=args.lookup_max_n)
    return {
        "mode": "demo-cpu",
        "config": "trainer/configs/demo.toml",
        "checkpoint_step": step,
        "train_s": train_s,
        "max_new_tokens": demo.gen_len,
        "held_out": run_eval(target, drafter, held, demo.gen_len),
        "baselines": {"prompt_lookup": measure(target, lookup, held, demo.gen_len)},
        "train_prompts": run_eval(target, drafter, seen, demo.gen_len),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = help_parser(__doc__)
    p.add_argument(
        "--out",
        default=None,
        help=f"write the results as JSON here (GPU run: default {RESULTS.relative_to(ROOT)})",
    )
    p.add_argument("--work", default="/tmp/dflash-bench-eval", help="assets and run folders")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--demo-cpu", action="store_true", help="the demo drafter's figure")
    p.add_argument(
        "--corpus-bytes",
        type=int,
        default=24_000_000,
        help="bytes of standard-library sources read (the corpus cap)",
    )
    p.add_argument(
        "--holdout-every",
        type=int,
        default=20,
        help="every K-th file is held out: the evaluation's prompts",
    )
    p.add_argument("--vocab", type=int, default=8192, help="the target's byte-level BPE vocabulary")
    p.add_argument("--target-layers", type=int, default=8, help="the target's decoder layers")
    p.add_argument("--target-hidden", type=int, default=768, help="the target's hidden size")
    p.add_argument(
        "--target-seq", type=int, default=512, help="the target's training sequence length"
    )
    p.add_argument("--target-batch", type=int, default=32, help="the target's training batch")
    p.add_argument("--target-lr", type=float, default=1e-3, help="the target's learning rate")
    p.add_argument(
        "--target-steps",
        type=int,
        default=1750,
        help="target training steps (1,750: what 90 s gave on an H200); 0: --target-seconds",
    )
    p.add_argument(
        "--target-seconds", type=float, default=90.0, help="the time budget when --target-steps 0"
    )
    p.add_argument(
        "--samples",
        type=sample_counts,
        default=[2048, 20480, 262144],
        help="training samples of each drafter point, comma-separated (e.g. 2048,20480)",
    )
    p.add_argument(
        "--train-data",
        type=paths,
        default=None,
        help="train on these files or shard folders, comma-separated (made with the "
        "--reuse-target target) instead of generating data here",
    )
    p.add_argument(
        "--gen-temperatures",
        type=temperatures,
        default=[1.0],
        help="one generated data set per temperature, interleaved (0: greedy), e.g. 0,0.8",
    )
    p.add_argument(
        "--gen-sampled-prefix",
        type=int,
        default=16,
        metavar="N",
        help="a temperature > 0 samples only the first N answer tokens (then greedy: "
        "trainer.generation.generate --sampled-prefix)",
    )
    p.add_argument(
        "--prepare-only",
        action="store_true",
        help="stop once the target, the training data and the evaluation prompts are in --work",
    )
    p.add_argument(
        "--reuse-target", action="store_true", help="reuse the target saved in --work/target"
    )
    p.add_argument(
        "--unseen-every",
        type=int,
        default=None,
        metavar="K",
        help="keep every K-th file that is not held out from the target (0: none, else ≥ 2; "
        f"default {DEFAULT_UNSEEN_EVERY}, or the split a --reuse-target target was trained with)",
    )
    p.add_argument(
        "--unseen-past-cap",
        type=int,
        default=0,
        metavar="BYTES",
        help="also keep this many bytes of files past --corpus-bytes for the drafter's prompts, "
        "then of installed packages' sources where the standard library ends first (the "
        "target's files and the held-out ones stay as they are; 0: none)",
    )
    p.add_argument(
        "--drafter-prompts",
        choices=("target-files", "unseen-files"),
        default=None,
        help="where the drafter's generated data gets its prompts: windows of the target's "
        "training files, or of the files kept from it (the default where --unseen-every keeps "
        "any); with --train-data, what the given data were made from (for the record)",
    )
    p.add_argument(
        "--prompt-len", type=int, default=64, help="tokens of each generation and evaluation prompt"
    )
    p.add_argument("--gen-len", type=int, default=192, help="new tokens of each generated answer")
    p.add_argument(
        "--gen-batch", type=int, default=2048, help="trainer.generation.generate's batch size"
    )
    p.add_argument(
        "--gen-compare",
        type=int,
        default=4096,
        metavar="N",
        help="time plain transformers generate against trainer.generation.decode on the first N prompts, "
        "batches of --gen-batch, the first a warm-up (0: skip)",
    )
    p.add_argument("--drafter-layers", type=int, default=4, help="the drafter's layers")
    p.add_argument(
        "--block-size", type=int, default=8, help="B: the drafter's block (slots per draft)"
    )
    p.add_argument("--drafter-batch", type=int, default=128, help="sequences per drafter step")
    p.add_argument("--anchors", type=int, default=64, help="blocks per sequence")
    p.add_argument("--drafter-lr", type=float, default=2e-3, help="the drafter's learning rate")
    p.add_argument(
        "--feature-layers",
        type=layer_list,
        default=None,
        help="the target layers the drafter reads, e.g. 1,2,4,5,6 (default: the trainer's)",
    )
    p.add_argument("--kl-weight", type=float, default=LossConfig().kl_weight, help="loss.kl_weight")
    add_overrides_option(
        p,
        "a drafter training setting over the benchmark's own, e.g. loss.gamma=2 (repeatable)",
    )
    p.add_argument(
        "--drafter-steps",
        type=step_counts,
        default=None,
        help="steps of every point, or one count per point, smallest point first (default: "
        f"{DEFAULT_EPOCHS} epochs, at least {MIN_STEPS}; 0: as many as fit --drafter-seconds)",
    )
    p.add_argument(
        "--drafter-seconds",
        type=float,
        default=120.0,
        help="training time per point with --drafter-steps 0",
    )
    p.add_argument(
        "--eval-prompts",
        type=int,
        default=128,
        help="held-out prompts, drawn in a fixed order (a run with 32 has the first 32 of a run "
        "with 128); the 95 %% interval of τ is about ±0.4 on 32 and ±0.2 on 128",
    )
    p.add_argument(
        "--max-new-tokens", type=int, default=128, help="new tokens per evaluation prompt"
    )
    p.add_argument("--lookup-max-n", type=int, default=4, help="prompt lookup: n-grams n…1")
    p.add_argument(
        "--export-dtype",
        choices=sorted(DTYPES),
        default="bf16",
        help="the weights of the exported folder each point is also measured from (as served)",
    )
    args = p.parse_args(argv)
    if args.train_data and not args.reuse_target:
        p.error("--train-data needs --reuse-target: data made with the target saved in --work")
    resolve_split(args)
    if args.unseen_every < 0 or args.unseen_every == 1:
        p.error("--unseen-every: 0 (no file kept from the target) or K ≥ 2")
    if args.unseen_past_cap < 0:
        p.error("--unseen-past-cap: a byte count ≥ 0")
    if args.drafter_prompts == "unseen-files" and not (args.unseen_every or args.unseen_past_cap):
        p.error(
            "--drafter-prompts unseen-files needs files kept from the target: --unseen-every K "
            "or --unseen-past-cap BYTES (a --reuse-target target keeps the split it was trained "
            "with)"
        )
    if args.smoke:
        small = dict(
            corpus_bytes=150_000,
            vocab=300,
            target_layers=2,
            target_hidden=64,
            target_seq=64,
            target_batch=8,
            target_seconds=30.0,
            target_steps=20,
            samples=[8, 16],
            prompt_len=8,
            gen_len=24,
            gen_batch=8,
            gen_compare=16,
            drafter_layers=1,
            block_size=4,
            drafter_batch=4,
            anchors=8,
            drafter_seconds=0.3,  # steps from the time budget unless given: calibration runs
            eval_prompts=2,
            max_new_tokens=12,
        )
        for key, value in small.items():
            setattr(args, key, value)
        args.drafter_steps = args.drafter_steps or [0]
    steps = args.drafter_steps or [1]
    if len(steps) not in (1, len(args.samples)) or (len(steps) > 1 and 0 in steps):
        p.error(
            f"--drafter-steps: one count for all points or one per point ({len(args.samples)} "
            f"from --samples), each ≥ 1; got {','.join(map(str, steps))}"
        )
    try:  # a bad --set is refused now, not after minutes of target training
        drafter_config(args, Path("later"), Path("later"), torch.device("cpu"))
    except TrainConfigError as exc:
        p.error(f"--set: {exc}")
    if args.demo_cpu:
        args.eval_prompts = (
            16 if args.eval_prompts == p.get_default("eval_prompts") else args.eval_prompts
        )
    if args.out is None and not (args.smoke or args.demo_cpu):
        args.out = str(RESULTS)
    return args


def sample_counts(text: str) -> list[int]:
    counts = sorted({int(part) for part in text.split(",") if part.strip()})
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive counts like 2048,20480, got {text!r}")
    return counts


def step_counts(text: str) -> list[int]:
    """Steps per point in the order given (not sorted: they pair with the sorted samples)."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"expected step counts like 600,1200, got {text!r}")
    return counts


def paths(text: str) -> list[str]:
    found = [part.strip() for part in text.split(",") if part.strip()]
    if not found:
        raise argparse.ArgumentTypeError(f"expected paths like a.jsonl,shards/, got {text!r}")
    return found


def temperatures(text: str) -> list[float]:
    try:
        found = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        found = []
    if not found or any(t < 0 for t in found) or len(set(found)) != len(found):
        raise argparse.ArgumentTypeError(
            f"expected distinct temperatures ≥ 0 like 0,0.8, got {text!r}"
        )
    return found


def layer_list(text: str) -> list[int]:
    try:
        found = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        found = []
    if not found or any(i < 0 for i in found):
        raise argparse.ArgumentTypeError(f"expected layer indices ≥ 0 like 1,3,5, got {text!r}")
    return found


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:  # tiny shapes: one thread is faster than two fighting over a shared CPU
        torch.set_num_threads(1)
    start = time.perf_counter()
    result = demo_cpu(args) if args.demo_cpu else gpu_run(args)
    result["total_s"] = time.perf_counter() - start
    result["complete"] = True
    import transformers

    result["environment"] = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "python": sys.version.split()[0],
    }
    if args.out:
        write_json(args.out, result)
    print(compact_json(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
