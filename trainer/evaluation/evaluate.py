"""Measure what a drafter is worth beside a baseline, from the command line.

    python -m trainer evaluate --config trainer/configs/demo.toml --checkpoint runs/demo \\
        --prompts prompts.jsonl --max-new-tokens 64 [--baseline prompt-lookup|none] [--json]
    python -m trainer evaluate --config train.toml --drafter ./drafter --engine-report vllm.jsonl

The drafter (a training checkpoint, or an exported folder with `--drafter`) decodes the prompts
by greedy block speculative decoding against the frozen target (`trainer.evaluation.speculative`: τ,
per-slot acceptance, speed-up in target forwards, lossless check). Beside it, the same prompts
are decoded with a baseline drafter (`--baseline`, default prompt lookup,
`trainer.evaluation.prompt_lookup`) behind the same `BlockDrafter` interface; the plain greedy output is
decoded once for both lossless checks.

With `--engine-report`, the prompts, budgets and per-request acceptance an inference engine
reported (`trainer.evaluation.engine_report`) are decoded the same way here (`trainer.evaluation.engine_check`): the
report says, request by request, where the engine's output or accepted counts part from the
project's; exit 1 when any do.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.base.errors import TrainerError
from trainer.data.dataset import template_options
from trainer.data.eval_prompts import load_prompts
from trainer.evaluation.drafters import BlockDrafter, DFlashDrafter
from trainer.evaluation.engine_check import EngineComparison
from trainer.evaluation.prompt_lookup import BASELINES, baseline_drafter
from trainer.evaluation.report import EvalReport, evaluate
from trainer.evaluation.speculative import BATCH_TOKENS, greedy_outputs
from trainer.evaluation.tau_bootstrap import tau_difference
from trainer.model.drafter import Drafter
from trainer.model.target import Target
from trainer.settings.loading import config_options

log = logging.getLogger(__name__)


# ---- beside a baseline ------------------------------------------------------------------------


@dataclass(frozen=True)
class Comparison:
    """The drafter's report and its baselines' on the same prompts (keys: "prompt_lookup")."""

    drafter: EvalReport
    baselines: dict[str, EvalReport]

    def summary(self) -> str:
        lines = [f"drafter        {self.drafter.summary()}"]
        for name, report in self.baselines.items():
            label = name.replace("_", " ")
            lines.append(f"{label:<14} {report.summary()}")
            line = _versus(self.drafter.tau, report.tau, label)
            lines.append(f"{'':<14} {line}{_paired(self.drafter, report)}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """The drafter's fields at the top level, each baseline's under `baselines.<name>`."""
        return {
            **asdict(self.drafter),
            "baselines": {name: asdict(r) for name, r in self.baselines.items()},
        }


def _paired(drafter: EvalReport, base: EvalReport) -> str:
    """`; τ difference +0.61 (95% +0.45…+0.78)`, paired over the same prompts."""
    a, b = drafter.prompt_counts, base.prompt_counts
    if not a or not b or len(a) != len(b):
        return ""
    diff, lo, hi = tau_difference(a, b)
    return f"; tau difference {diff:+.2f} (95% {lo:+.2f}…{hi:+.2f}, paired over the prompts)"


def _versus(tau: float, base: float, label: str) -> str:
    """How the drafter's tokens gained per verify (τ − 1) compare with the baseline's."""
    if base > 1:
        return f"tau − 1 is x{(tau - 1) / (base - 1):.2f} {label}'s ({tau:.2f} vs {base:.2f})"
    return f"{label} accepted nothing (tau {tau:.2f} vs {base:.2f})"


def compare(
    target: Target,
    drafter: BlockDrafter,
    baselines: dict[str, BlockDrafter],
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    check_lossless: bool = True,
    eos: Sequence[int] | None = None,
    progress: Callable[[int, int, float], None] | None = None,
    batch_tokens: int = BATCH_TOKENS,
) -> Comparison:
    """`evaluate` of the drafter and of each baseline on the same prompts; the plain greedy
    output the lossless check needs is decoded once for all of them. `progress` follows the
    drafter's prompts (see `evaluate`)."""
    expected = (
        greedy_outputs(target, prompts, max_new_tokens, eos=eos, batch_tokens=batch_tokens)
        if check_lossless and baselines
        else None
    )

    def one(d: BlockDrafter, progress: Callable[[int, int, float], None] | None) -> EvalReport:
        return evaluate(
            target, d, prompts, max_new_tokens=max_new_tokens, check_lossless=check_lossless,
            eos=eos, expected=expected, progress=progress, batch_tokens=batch_tokens,
        )  # fmt: skip

    return Comparison(one(drafter, progress), {name: one(b, None) for name, b in baselines.items()})


# ---- checkpoint → drafter, and the entry point ------------------------------------------------


def load_drafter(config: Any, checkpoint: str | Path, target: Target) -> tuple[Drafter, int]:
    """The drafter of a checkpoint folder (`step-…`) or of the newest verified one in a run
    folder; refuses one written with other `model.*` settings."""
    from trainer.model import checkpoint as ckpt
    from trainer.model.drafter import shape_from_target
    from trainer.settings.config import diff_settings

    path = Path(checkpoint)
    if (path / ckpt.STATE).is_file():
        manifest, why = ckpt.verify(path)
        if manifest is None:
            raise ckpt.CheckpointMismatch(path, [why])
    else:
        found = ckpt.find_resumable(path)
        if found.path is None:
            raise TrainerError(
                f"{path}: no verified checkpoint",
                hint="Pass a step-XXXXXXXX folder or the run folder training wrote to.",
            )
        path, manifest = found.path, found.manifest
    assert manifest is not None
    wanted = {k: v for k, v in config.model_data_settings().items() if k.startswith("model.")}
    saved = {k: v for k, v in manifest.settings.items() if k.startswith("model.")}
    changed = [k for k in diff_settings(saved, wanted) if k != "model.target"]
    if changed:
        raise ckpt.CheckpointMismatch(path, changed)
    shape = shape_from_target(target.config, config.model, num_features=len(target.layers))
    drafter = Drafter(shape).to(target.device)
    state = ckpt.load_state(path, map_location=target.device)
    drafter.load_state_dict(state["worker"]["drafter"])
    return drafter.eval(), manifest.step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m trainer evaluate",
        description=__doc__.split("\n")[0],
        parents=[config_options()],
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint", help="a step-XXXXXXXX folder or a run folder")
    which.add_argument(
        "--drafter", help="an exported folder (config.json + model.safetensors), as served"
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--prompts",
        help="JSONL: tokenized samples or chat messages (default: eval.prompts of the config, "
        "else the demo's held-out prompts)",
    )
    source.add_argument(
        "--engine-report",
        help="JSONL of an engine's requests (prompt, output, accepted counts per verify step: "
        "trainer/evaluation/engine_report.py): decode the same prompts and say where the engine parts "
        "from the project (exit 1 when it does)",
    )
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts only")
    p.add_argument("--no-lossless-check", action="store_true", help="skip plain greedy decoding")
    p.add_argument(
        "--batch-tokens",
        type=int,
        default=BATCH_TOKENS,
        help="prompts decoded together: rows × (longest prompt + new tokens) per forward at "
        "most (one prompt at least); lower it if the target's forward runs out of memory",
    )
    p.add_argument(
        "--baseline",
        choices=BASELINES,
        default="prompt-lookup",
        help="also decode the same prompts with this drafter and report it beside yours",
    )
    p.add_argument("--lookup-max-n", type=int, default=4, help="prompt lookup: longest n-gram")
    p.add_argument("--lookup-min-n", type=int, default=1, help="prompt lookup: shortest n-gram")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    args = p.parse_args(argv)
    if args.batch_tokens < 1:
        p.error("--batch-tokens must be ≥ 1")
    if not 1 <= args.lookup_min_n <= args.lookup_max_n:
        p.error("need 1 ≤ --lookup-min-n ≤ --lookup-max-n")
    return args


def load_block_drafter(args: argparse.Namespace, config: Any) -> tuple[Target, DFlashDrafter, str]:
    """The target and the drafter to judge, from the command line: an exported folder
    (`--drafter`, read only as the engines read it, with its own target layers) or a training
    checkpoint; and what it is, for the report."""
    from trainer.setup.runtime import load_configured_target

    if args.drafter:
        from trainer.export.hf_format import load_for_target

        target, drafter, step = load_for_target(args.drafter, config)
    else:
        target = load_configured_target(config)
        drafter, step = load_drafter(config, Path(args.checkpoint), target)
    block = DFlashDrafter(
        drafter, embed_weight=target.embed_weight, lm_head_weight=target.lm_head_weight
    )
    return target, block, f"step {step}"


def run_config(args: argparse.Namespace) -> Any:
    """The training config of the command line, its demo assets resolved beside the run the
    drafter comes from, and the thread count applied."""
    from trainer.settings.loading import load_config
    from trainer.setup.runtime import demo_of_checkpoint

    config = load_config(args.config, args.overrides)
    config = demo_of_checkpoint(config, Path(args.checkpoint or args.drafter))
    if config.run.threads:
        torch.set_num_threads(config.run.threads)
    return config


def check_report(args: argparse.Namespace) -> EngineComparison:
    """`--engine-report`: the engine's requests against the project's decoding of them."""
    from trainer.evaluation.engine_check import check_engine
    from trainer.evaluation.engine_report import read_report

    requests = read_report(args.engine_report)
    if args.limit is not None:
        requests = requests[: args.limit]
    target, block, what = load_block_drafter(args, run_config(args))
    if not args.json:
        _say(f"checking {len(requests)} engine requests against {what}")
    return check_engine(target, block, requests, batch_tokens=args.batch_tokens)


def run(args: argparse.Namespace) -> Comparison:
    config = run_config(args)
    target, block, what = load_block_drafter(args, config)
    prompts = load_prompts(
        args.prompts or default_prompts(config),
        tokenizer_dir=config.model.target,
        limit=args.limit,
        template=template_options(config.data),
    )
    say = None if args.json else _say  # --json: stdout holds the report alone
    (say or log.info)(f"evaluating {what} on {len(prompts)} prompts")
    base = baseline_drafter(
        args.baseline, block.block_size, max_n=args.lookup_max_n, min_n=args.lookup_min_n
    )
    return compare(
        target,
        block,
        {} if base is None else {args.baseline.replace("-", "_"): base},
        prompts,
        max_new_tokens=args.max_new_tokens,
        check_lossless=not args.no_lossless_check,
        progress=None if say is None else _progress_printer(say),
        batch_tokens=args.batch_tokens,
    )


def default_prompts(config: Any) -> str:
    """The prompts when `--prompts` is not given: `eval.prompts`, else the demo's held-out
    prompts (built with its assets: prompts the drafter never trained on)."""
    if config.eval.prompts:
        return str(config.eval.prompts)
    if config.demo.enabled:
        from trainer.setup.demo import HELDOUT

        return str(Path(config.data.path).with_name(HELDOUT))
    raise TrainerError(
        "no prompts to evaluate on",
        hint="Pass --prompts FILE (JSONL in a training format, prompts the drafter did not "
        "train on), or set eval.prompts in the config.",
    )


def _say(line: str) -> None:
    print(line, flush=True)  # flushed: `dflash eval` streams stdout as it comes


def _progress_printer(say: Callable[[str], None]) -> Callable[[int, int, float], None]:
    def progress(done: int, total: int, tau: float) -> None:
        say(f"prompt {done}/{total} done: tau so far {tau:.2f}")

    return progress


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr, force=True)
    try:
        report: Comparison | EngineComparison = (
            check_report(args) if args.engine_report else run(args)
        )
    except TrainerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json()) if args.json else report.summary())
    return 1 if isinstance(report, EngineComparison) and not report.agree else 0
