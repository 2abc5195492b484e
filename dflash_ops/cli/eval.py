"""`dflash eval`: measure the drafter by speculative decoding at the place (τ, lossless)."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

import typer

from dflash_ops.cli.context import workspace
from dflash_ops.cli.foreground import drain
from dflash_ops.cli.options import (
    CheckpointOption,
    TargetChoice,
    with_target,
)
from dflash_ops.commands import eval as evaluation

app = typer.Typer()


class Baseline(StrEnum):
    prompt_lookup = "prompt-lookup"
    none = "none"


@app.command(name="eval")
@with_target
def eval_(
    ctx: typer.Context,
    prompts: Annotated[
        str | None,
        typer.Option(
            "--prompts",
            metavar="PATH",
            help="Prompt JSONL at the place (absolute; relative to here for a local target). "
            "Default: eval.prompts of [train], else the demo's held-out prompts.",
        ),
    ] = None,
    checkpoint: CheckpointOption = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option("--max-new-tokens", metavar="N", min=1, help="Tokens to decode per prompt."),
    ] = None,
    limit: Annotated[
        int | None,
        typer.Option("--limit", metavar="N", min=1, help="Use the first N prompts only."),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the evaluator's report as one JSON object.")
    ] = False,
    baseline: Annotated[
        Baseline,
        typer.Option(
            "--baseline",
            help="Also decode the prompts with this drafter and report its tau beside yours.",
        ),
    ] = Baseline.prompt_lookup,
    batch_tokens: Annotated[
        int | None,
        typer.Option(
            "--batch-tokens",
            metavar="N",
            min=1,
            help="Prompts decoded together: rows × (longest prompt + new tokens) per target "
            "forward at most (8192); lower it if the target runs out of memory, 1 for one "
            "prompt at a time.",
        ),
    ] = None,
    *,
    where: TargetChoice,
) -> None:
    """Decode with the drafter at the place: τ, acceptance per slot, speed-up, lossless check,
    and the same figures for prompt lookup (n-gram drafting) on the same prompts.

    Runs `python -m trainer evaluate` in the foreground, in the current release with its
    train.toml, the target's python and the [job] env; prints its report and exits with its
    exit code (2 when it fails, e.g. a lossless violation).

    \b
    Examples:
      dflash eval                                  # the demo: its held-out prompts
      dflash eval --prompts /data/heldout.jsonl
      dflash eval --prompts /data/heldout.jsonl --checkpoint step-00000300 --limit 16
      dflash eval --checkpoint 20260102T030405.678Z  # a run a fresh deploy archived
      dflash eval --prompts /data/heldout.jsonl --max-new-tokens 128 --json
      dflash eval --prompts /data/heldout.jsonl --baseline none
    """
    with workspace(ctx, where) as ws:
        request = evaluation.EvalRequest(
            prompts=prompts,
            checkpoint=checkpoint,
            max_new_tokens=max_new_tokens,
            limit=limit,
            as_json=as_json,
            baseline=baseline.value,
            batch_tokens=batch_tokens,
        )
        stream = evaluation.start(ws, request)
        code = drain(stream, what="evaluation", failure=lambda s: evaluation.failure(ws, s))
    raise typer.Exit(code)
