"""Target-generated training data: the target answers prompts; the answers become token shards.

    python -m trainer generate --config train.toml --prompts prompts.jsonl --out /data/gen
    torchrun --nproc-per-node 8 -m trainer generate --config train.toml --prompts p.jsonl --out D
    dflash generate --prompts /data/prompts.jsonl --out /data/gen     # at the place, in tmux

Then train with `data.path = "/data/gen"` (the directory).

Steps, in order (every rank does the same and agrees without talking):
1. read the settings (`--config`: the target is `model.target`, the device `run.device`);
2. scan the prompt files: bad lines are named (file:line) and skipped, or refused (`--strict`);
   duplicates are dropped; the unique prompts are cut into shards of `--shard-size`;
3. compare with the manifest in `--out` when there is one: other settings or prompts are
   refused (a new `--out`, or remove it), the same ones resume — finished shards are skipped;
4. rank r of W generates shards r, r+W, …: prompts rendered (chat template with the generation
   prompt), batched by length, decoded (`trainer.generation.decode`; with `--sampled-prefix N`, N tokens
   sampled first, then the greedy answer), each shard written atomically (`trainer.data.shards`): a
   shard file that exists is complete;
5. rank 0 waits for every shard, then writes the manifest's counts and `complete: true`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.base.errors import TrainerError
from trainer.base.stopping import ending_at_once
from trainer.data import prompt_file
from trainer.settings.config import TrainConfig
from trainer.settings.loading import config_options, load_config

# No torch at import: `main` sets its signal handlers first, then the heavy modules load.
INTERRUPTED = "finished shards are kept: run the same command to resume"

log = logging.getLogger("trainer.generation.generate")


class GenerateError(TrainerError):
    """Generation cannot start or continue as asked."""


@dataclass(frozen=True, kw_only=True)
class GenerateSettings:
    """What the shards depend on; a resume with other values is refused."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    enable_thinking: bool | None = None
    shard_size: int = 1024
    max_prompt_len: int = 0  # 0: data.max_len − max_new_tokens
    sampled_prefix: int = 0  # first N answer tokens sampled (they join the prompt), then greedy

    def __post_init__(self) -> None:
        if self.max_new_tokens < 2:
            raise GenerateError(
                f"--max-new-tokens must be ≥ 2, got {self.max_new_tokens}",
                hint="A drafter learns from answers of at least two tokens.",
            )
        if self.shard_size < 1:
            raise GenerateError("--shard-size must be ≥ 1", hint="Pass a positive count.")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise GenerateError(
                "--temperature must be ≥ 0 and --top-p in (0, 1]", hint="Fix the sampling flags."
            )
        if self.sampled_prefix and self.temperature == 0:
            raise GenerateError(
                "--sampled-prefix samples at --temperature, which is 0 (greedy)",
                hint="Pass --temperature (e.g. 1.0) with --sampled-prefix, or drop it.",
            )
        if not 0 <= self.sampled_prefix <= self.max_new_tokens - 2:
            raise GenerateError(
                f"--sampled-prefix must be in 0…{self.max_new_tokens - 2} (--max-new-tokens − 2: "
                f"the greedy answer after it needs two tokens), got {self.sampled_prefix}",
                hint="Lower --sampled-prefix or raise --max-new-tokens.",
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from trainer.generation.decode import ENGINES

    p = argparse.ArgumentParser(
        prog="python -m trainer generate",
        description=__doc__.split("\n")[0],
        parents=[config_options()],
    )
    p.add_argument("--prompts", required=True, action="append", help="prompt JSONL (repeatable)")
    p.add_argument("--out", required=True, help="shard directory (created; resumed when present)")
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=32, help="prompts decoded together")
    p.add_argument(
        "--engine",
        choices=ENGINES,
        default="auto",
        help="decoding engine: static (a CUDA graph per step; auto picks it on CUDA where the "
        "model allows) or dynamic (a growing cache, finished rows dropped)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument(
        "--sampled-prefix",
        type=int,
        default=0,
        metavar="N",
        help="sample only the first N answer tokens (at --temperature; they join the prompt, "
        "unsupervised), then answer greedily: greedy answers from contexts the target would not "
        "have written itself (within --max-new-tokens)",
    )
    p.add_argument("--seed", type=int, default=0, help="sampling seed (mixed with the shard)")
    think = p.add_mutually_exclusive_group()
    think.add_argument(
        "--enable-thinking", dest="enable_thinking", action="store_true", default=None
    )
    think.add_argument("--disable-thinking", dest="enable_thinking", action="store_false")
    p.add_argument("--shard-size", type=int, default=1024, help="prompts per shard")
    p.add_argument("--max-prompt-len", type=int, default=0, help="0: data.max_len − max-new-tokens")
    p.add_argument("--limit", type=int, default=0, help="use the first N unique prompts only")
    p.add_argument("--strict", action="store_true", help="refuse a bad prompt line (default: skip)")
    p.add_argument("--log-every", type=float, default=10.0, help="seconds between progress lines")
    return p.parse_args(argv)


def settings_of(args: argparse.Namespace) -> GenerateSettings:
    return GenerateSettings(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        enable_thinking=args.enable_thinking,
        shard_size=args.shard_size,
        max_prompt_len=args.max_prompt_len,
        sampled_prefix=args.sampled_prefix,
    )


def plan_manifest(
    config: TrainConfig, settings: GenerateSettings, scan: prompt_file.Scan, renderer: Any
) -> dict[str, Any]:
    """The manifest as written before generating: what every shard depends on."""
    num_shards = -(-len(scan.refs) // settings.shard_size)
    sampling: dict[str, Any] = {
        "temperature": settings.temperature,
        "top_p": settings.top_p,
        "seed": settings.seed,
        "greedy": settings.temperature == 0 or settings.sampled_prefix > 0,  # the answers
    }
    if settings.sampled_prefix:  # absent otherwise: older manifests resume as before
        sampling["sampled_prefix"] = settings.sampled_prefix
    return {
        "format": "dflash-shards/1",
        "target": config.model.target,
        "template": renderer.describe(),
        "sampling": sampling,
        "max_new_tokens": settings.max_new_tokens,
        "max_prompt_len": settings.max_prompt_len,
        "shard_size": settings.shard_size,
        "prompt_files": scan.files,
        "prompts_fingerprint": scan.fingerprint,
        "prompts": {
            "unique": len(scan.refs),
            "duplicates": scan.duplicates,
            "bad_lines": len(scan.bad),
            "bad": scan.bad[:1000],
        },
        "num_shards": num_shards,
        "complete": False,
    }


KEYS_THAT_MATTER = (
    "target", "template", "sampling", "max_new_tokens", "max_prompt_len", "shard_size",
    "prompts_fingerprint", "num_shards",
)  # fmt: skip


def check_resume(out: Path, planned: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest already in `out`, refused when it differs in what the shards depend on."""
    from trainer.data.shards import MANIFEST

    path = out / MANIFEST
    if not path.is_file():
        return None
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise GenerateError(
            f"{path} is not JSON ({exc.msg})", hint="Remove it to start over in that folder."
        ) from exc
    changed = [k for k in KEYS_THAT_MATTER if old.get(k) != planned.get(k)]
    if changed:
        raise GenerateError(
            f"{out} holds shards made with other settings or prompts: {', '.join(changed)} differ",
            hint="Use a new --out, or the same settings and prompts to resume, or remove the folder.",
        )
    return old


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def resolve(config: TrainConfig, out: Path, *, rank: int) -> TrainConfig:
    """With the demo enabled, build (or reuse) its target next to `out`: rank 0 builds, the
    other ranks wait for its completion marker (never two writers)."""
    if not config.demo.enabled:
        return config
    from trainer.setup.demo import MARKER
    from trainer.setup.runtime import resolve_demo

    folder = (
        Path(config.demo.folder) if config.demo.folder else out.resolve().parent / "demo-assets"
    )
    while rank != 0 and not (folder / MARKER).is_file():
        time.sleep(0.5)
    return resolve_demo(config, out)


def main(argv: list[str] | None = None) -> int:
    """The exit code: 0 done, 2 refused (one `error:` line), 130 interrupted. SIGINT or SIGTERM
    end the process at once at any moment, its imports included (`ending_at_once`): a shard
    is written whole or not at all, so nothing is lost and the same command resumes."""
    with ending_at_once(f"interrupted; {INTERRUPTED}"):
        args = parse_args(argv)
        logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
        try:
            run(args)
        except TrainerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # off the main thread, where no handler could be set
            print(f"interrupted; {INTERRUPTED}", file=sys.stderr)
            return 130
        return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Steps 1–5 of the module docstring on this rank; returns this rank's summary."""
    from trainer.data.shards import MANIFEST
    from trainer.generation.generate_worker import Worker, world_from_env

    out = Path(args.out)
    settings = settings_of(args)
    config = load_config(args.config, [*args.overrides, f"data.path={out}"])
    world = world_from_env()
    if settings.max_prompt_len == 0:
        budget = config.data.max_len - settings.max_new_tokens
        if budget < 1:
            raise GenerateError(
                f"data.max_len ({config.data.max_len}) leaves no room for a prompt before "
                f"{settings.max_new_tokens} new tokens",
                hint="Raise data.max_len, lower --max-new-tokens, or pass --max-prompt-len.",
            )
        settings = GenerateSettings(**{**vars(settings), "max_prompt_len": budget})
    out.mkdir(parents=True, exist_ok=True)
    config = resolve(config, out, rank=world.rank)
    started = time.perf_counter()
    scan = prompt_file.scan(args.prompts, strict=args.strict)
    if args.limit:
        scan.refs = scan.refs[: args.limit]
    for line in scan.bad[:20]:
        log.warning("skipped %s", line)
    if len(scan.bad) > 20:
        log.warning("… and %d more bad lines (all listed in the manifest)", len(scan.bad) - 20)
    if not scan.refs:
        raise GenerateError(
            f"no usable prompt in {', '.join(scan.files)}",
            hint="Each line: {'messages': [...]}, {'text': '...'} or {'input_ids': [...]}.",
        )
    renderer = prompt_file.Renderer(config.model.target, enable_thinking=settings.enable_thinking)
    if settings.enable_thinking is not None and not renderer.template_has_thinking:
        log.warning("the chat template has no enable_thinking switch: the flag changes nothing")
    planned = plan_manifest(config, settings, scan, renderer)
    previous = check_resume(out, planned)
    if world.rank == 0 and previous is None:
        write_json(out / MANIFEST, planned)
    log.info(
        "%s prompts (%d duplicates, %d bad lines skipped) in %d shards; scanned in %.1f s",
        f"{len(scan.refs):,}", scan.duplicates, len(scan.bad), planned["num_shards"],
        time.perf_counter() - started,
    )  # fmt: skip
    worker = Worker(
        config, settings, scan, renderer, out, world=world,
        batch_size=args.batch_size, strict=args.strict, log_every=args.log_every,
        engine=args.engine,
    )  # fmt: skip
    summary = worker.run()
    if world.rank == 0:
        worker.wait_all()
        final = {**planned, **worker.totals(), "complete": True}
        write_json(out / MANIFEST, final)
        log.info("done: %s", json.dumps(worker.totals()["counts"]))
    return summary
