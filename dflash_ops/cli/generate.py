"""`dflash generate`: the target answers prompts at the place, in the job's tmux session."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from dflash_ops.cli import output
from dflash_ops.cli.context import workspace
from dflash_ops.cli.options import ForceOption, TargetChoice, with_target
from dflash_ops.commands import generate as generation

app = typer.Typer()


class Engine(StrEnum):
    """`trainer.generation.generate --engine` (trainer/generation/decode.py)."""

    auto = "auto"
    static = "static"
    dynamic = "dynamic"


def _opt(flag: str, text: str, **kw: object) -> object:
    return typer.Option(flag, help=text, **kw)  # type: ignore[arg-type]


@app.command()
@with_target
def generate(
    ctx: typer.Context,
    prompts: Annotated[
        list[str],
        _opt("--prompts", "Prompt JSONL at the place (absolute; repeatable).", metavar="PATH"),
    ],
    out: Annotated[
        str,
        _opt("--out", "Shard folder at the place (absolute); resumed when present.", metavar="DIR"),
    ],
    max_new_tokens: Annotated[
        int | None, _opt("--max-new-tokens", "Answer length cap (512).", min=2, metavar="N")
    ] = None,
    batch_size: Annotated[
        int | None,
        _opt("--batch-size", "Prompts decoded together per GPU (32).", min=1, metavar="N"),
    ] = None,
    engine: Annotated[
        Engine | None,
        _opt(
            "--engine",
            "Decoding engine: static (a CUDA graph per step; auto picks it on CUDA where the "
            "model allows) or dynamic (a growing cache, finished answers dropped).",
        ),
    ] = None,
    temperature: Annotated[
        float | None, _opt("--temperature", "0: greedy (the default).", min=0.0, metavar="T")
    ] = None,
    top_p: Annotated[float | None, _opt("--top-p", "Nucleus sampling (1.0).", metavar="P")] = None,
    sampled_prefix: Annotated[
        int | None,
        _opt(
            "--sampled-prefix",
            "Sample only the first N answer tokens at --temperature (they join the prompt), "
            "then answer greedily.",
            min=0,
            metavar="N",
        ),
    ] = None,
    seed: Annotated[int | None, _opt("--seed", "Sampling seed (0).", metavar="S")] = None,
    shard_size: Annotated[
        int | None, _opt("--shard-size", "Prompts per shard (1024).", min=1, metavar="N")
    ] = None,
    limit: Annotated[
        int | None, _opt("--limit", "Use the first N unique prompts.", min=1, metavar="N")
    ] = None,
    thinking: Annotated[
        bool | None,
        typer.Option(
            "--enable-thinking/--disable-thinking", help="For chat templates with the switch."
        ),
    ] = None,
    strict: Annotated[
        bool, _opt("--strict", "Refuse a bad prompt line (default: skip it, named).")
    ] = False,
    force: ForceOption = False,
    *,
    where: TargetChoice,
) -> None:
    """Make training data: the target answers prompts, as the job at the place (in tmux).

    Deploys a release whose job runs `python -m trainer generate` (torchrun over [job] gpus, one
    share of the prompts per GPU) and starts it like a training run: it survives a dropped
    connection, shows in `dflash logs` and `dflash status`, stops with `dflash stop`, and
    `dflash restart` resumes it (finished shards are kept). Then train on the folder:
    data.path = OUT in [train], and `dflash deploy`.

    \b
    Examples:
      dflash generate --prompts /data/prompts.jsonl --out /data/gen
      dflash generate --prompts /data/a.jsonl --prompts /data/b.jsonl --out /data/gen \\
          --max-new-tokens 1024 --disable-thinking
      dflash logs --follow
    """
    request = generation.GenerateRequest(
        prompts=tuple(prompts), out=out, max_new_tokens=max_new_tokens, batch_size=batch_size,
        engine=engine.value if engine else None, temperature=temperature, top_p=top_p,
        sampled_prefix=sampled_prefix, seed=seed, shard_size=shard_size, limit=limit,
        enable_thinking=thinking, strict=strict,
    )  # fmt: skip
    with workspace(ctx, where) as ws:
        report = generation.start(ws, request, force=force, say=output.info, warn=output.warn)
    output.success(
        f"Generating into {out} at {ws.target.describe()} (release {report.release}); job "
        f"{report.started.session!r} {'running' if report.started.running else 'exited already'}."
    )
    output.info("Follow it with: dflash logs --follow; train on it with data.path = that folder.")
