"""Check a training config before anything heavy loads, and before a deploy stops a running job.

    python -m trainer check --config train.toml [--set KEY=VALUE …] [--lines 20]

In order: the keys, types and combinations of the config (`trainer.settings.config`: the trainer's own
validation); the target folder (config.json readable, a supported family, the shape keys the
drafter copies, `model.target_layers` and `model.init_layers` in range, weights present); for a
target with linear-attention layers (Qwen3.5), what will run them at the job's device: the
kernels or the much slower reference (`trainer.model.linear_attention`); the data file (readable, its
first lines parse with the loader's own parsers — chat and text lines also rendered with the
target's tokenizer and chat template, as the loader does); `eval.prompts` readable. torch is
not imported for a dense target with a tokenized or demo config; a chat or text file loads
`transformers` for the tokenizer.

Exit 0 prints one `ok:` line per part. Exit 2: the config itself is invalid (an unknown key, a
bad type): one `error:` line naming the key and a `hint:`. Exit 1: the config is valid but what
it points at is not: one `error:` line per problem, naming the key and the file, each with a
`hint:`. Relative paths are taken from the current folder (the job runs in its release folder).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from trainer.base.errors import UnsupportedTarget
from trainer.model.fidelity import check_target_supported
from trainer.settings.config import TrainConfig, TrainConfigError
from trainer.settings.loading import config_options, load_config

# Target families whose layer shape the drafter copies (config.json `model_type`).
SUPPORTED_FAMILIES = ("qwen3", "qwen3_5", "qwen3_5_text", "qwen2", "llama", "mistral")
_SHAPE_KEYS: tuple[str, ...] = (
    "hidden_size",
    "num_attention_heads",
    "num_hidden_layers",
    "intermediate_size",
)
_SHAPE_KEYS += ("vocab_size",)
DEFAULT_LINES = 20


@dataclass(frozen=True)
class Problem:
    key: str  # the dotted key (or file) to change
    message: str
    hint: str


class CheckFailed(Exception):
    """One part of the check failed; carries the problem."""

    def __init__(self, problem: Problem) -> None:
        super().__init__(problem.message)
        self.problem = problem


def fail(key: str, message: str, hint: str) -> CheckFailed:
    return CheckFailed(Problem(key, message, hint))


# ---- the target ------------------------------------------------------------------------------


def target_config(config: TrainConfig) -> dict[str, Any]:
    """The language model's part of `model.target`'s config.json (multimodal configs keep it
    under `text_config`)."""
    folder = Path(config.model.target)
    hint = _TARGET_HINT
    if not folder.is_dir():
        raise fail("model.target", f"{folder} is not a folder", hint)
    try:
        raw = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise fail("model.target", f"{folder}/config.json cannot be read: {exc}", hint) from exc
    if not isinstance(raw, dict):
        raise fail("model.target", f"{folder}/config.json is not a JSON object", hint)
    text = raw.get("text_config")
    c = text if "hidden_size" not in raw and isinstance(text, dict) else raw
    return {"model_type": raw.get("model_type"), **c}


_TARGET_HINT = (
    "Set model.target to the local save_pretrained folder of the target (config.json, "
    "weights, tokenizer) as seen from the place."
)


def check_target(config: TrainConfig) -> str:
    """The target folder: a save_pretrained folder of a supported family, shaped for the drafter."""
    folder = Path(config.model.target)
    hint = _TARGET_HINT
    c = target_config(config)
    family = str(c.get("model_type") or "?")
    if family not in SUPPORTED_FAMILIES:
        raise fail(
            "model.target",
            f"{folder}/config.json: model_type {family!r} is not a supported target family",
            f"Supported: {', '.join(SUPPORTED_FAMILIES)} (docs/training.md).",
        )
    bad = [k for k in _SHAPE_KEYS if not (isinstance(c.get(k), int) and c[k] > 0)]
    if bad:
        raise fail(
            "model.target",
            f"{folder}/config.json: missing or not a positive integer: {', '.join(bad)}",
            hint,
        )
    try:  # the settings the served drafter cannot follow (activation, biases, rope), by name
        check_target_supported(SimpleNamespace(**c))
    except UnsupportedTarget as exc:
        raise fail("model.target", f"{folder}/config.json: {exc.args[0]}", exc.hint) from exc
    layers = c["num_hidden_layers"]
    out = [i for i in config.model.target_layers or [] if not 0 <= i <= layers - 2]
    if out:
        raise fail(
            "model.target_layers",
            f"{out} outside 0…{layers - 2} for the {layers}-layer target in {folder}",
            "Pick layers of the target, or leave model.target_layers unset (spread evenly).",
        )
    out = [i for i in config.model.init_layers or [] if not 0 <= i < layers]
    if out:
        raise fail(
            "model.init_layers",
            f"{out} outside 0…{layers - 1} for the {layers}-layer target in {folder}",
            "Pick layers of the target, or leave model.init_layers unset (random weights).",
        )
    _check_own_shape(config, c, folder)
    if not any(p.suffix in (".safetensors", ".bin") for p in folder.iterdir()):
        raise fail("model.target", f"{folder} has no weights (*.safetensors, *.bin)", hint)
    return f"target {folder}: {family}, {layers} layers, hidden {c['hidden_size']}"


def _check_own_shape(config: TrainConfig, c: dict[str, Any], folder: Path) -> None:
    """The drafter's own heads, key/value heads, head dimension and MLP width: key/value heads
    that divide the heads, and the target's own where the drafter starts from the target's
    layers."""
    m = config.model
    heads = c["num_attention_heads"]
    target_kv = c.get("num_key_value_heads") or heads
    try:
        m.attention_heads(heads, target_kv)
    except TrainConfigError as exc:
        raise fail(exc.key, f"{_message(exc)} (the target in {folder})", exc.hint) from exc
    head_dim = c.get("head_dim") or c["hidden_size"] // heads
    own = {
        "model.intermediate_size": (m.intermediate_size, c["intermediate_size"], "an MLP of {}"),
        "model.num_kv_heads": (m.num_kv_heads, target_kv, "{} key/value heads"),
        "model.num_heads": (m.num_heads, heads, "{} attention heads"),
        "model.head_dim": (m.head_dim, head_dim, "a head dimension of {}"),
    }
    for key, (value, target_value, what) in own.items():
        if m.init_layers and value not in (None, target_value):
            raise fail(
                key,
                f"{value} with model.init_layers: the target's layers in {folder} have "
                f"{what.format(target_value)}",
                f"Leave {key} unset to start from the target's layers, or model.init_layers "
                "unset to start the drafter's own shape from random weights.",
            )


def check_linear_attention(config: TrainConfig) -> str:
    """The target's linear-attention layers (a hybrid such as Qwen3.5): what will run them at
    the job's device, kernels or the much slower reference (`trainer.model.linear_attention`; imports
    `transformers`' modeling module, and torch, for such a target only)."""
    from trainer.model.linear_attention import describe, has_linear_attention

    c = target_config(config)
    if not has_linear_attention(c):
        return ""
    from trainer.setup.runtime import resolve_device

    return describe(c, device_type=resolve_device(config.run.device).type) or ""


# ---- the data --------------------------------------------------------------------------------


def check_data(config: TrainConfig, *, lines: int, render: bool = True) -> str:
    """data.path: its format, and its first `lines` lines as the loader parses them; chat and
    text lines also rendered with the target's tokenizer (`render`, when the target is good)."""
    from trainer.data.formats import check_head

    path = config.data.path
    if Path(path).is_dir():
        return _check_shards(config, lines)
    try:
        fmt, head = check_head(path, lines=lines)
    except TrainConfigError as exc:
        raise fail("data.path", _message(exc), exc.hint) from exc
    if not render:
        return f"data {path}: {fmt.name} JSONL, the first {len(head)} lines parse"
    if not fmt.needs_tokenizer:
        _check_ids(config, head)
        return f"data {path}: {fmt.name} JSONL, the first {len(head)} lines parse"
    samples = _render_head(config, fmt, lines)
    _check_ids(config, samples)
    return (
        f"data {path}: {fmt.name} JSONL, the first {len(head)} lines parse and render "
        f"({len(samples)} samples with the target's tokenizer)"
    )


def _check_shards(config: TrainConfig, lines: int) -> str:
    """A folder as data.path: token shards written by `trainer.generation.generate`, its first samples read."""
    from trainer.data.shards import ShardError, ShardSamples, is_shard_dir

    path = config.data.path
    if not is_shard_dir(path):
        raise fail(
            "data.path",
            f"{path} is a folder without token shards or a manifest",
            "Point data.path at a JSONL file, or at the --out folder of python -m trainer generate.",
        )
    try:
        samples = ShardSamples(path)
        head = [samples[i] for i in range(min(lines, len(samples)))]
    except ShardError as exc:
        raise fail("data.path", str(exc), exc.hint) from exc
    _check_ids(config, head)
    return f"data {path}: {len(samples)} samples in token shards, the first {len(head)} read"


def _check_ids(config: TrainConfig, samples: list[Any]) -> None:
    """Every token id is a row of the target's embedding."""
    vocab = int(target_config(config)["vocab_size"])
    top = max((max(s.input_ids, default=0) for s in samples), default=0)
    if top >= vocab:
        raise fail(
            "data.path",
            f"{config.data.path}: token id {top} is past the target's vocab_size {vocab}",
            "The data was tokenized for another model: tokenize it with this target's "
            "tokenizer (give the chat or text file itself as data.path).",
        )


def _render_head(config: TrainConfig, fmt: Any, lines: int) -> list[Any]:
    """Tokenize the first lines with the loader's own function; the first failure raises."""
    from trainer.data.chat import tokenize_file
    from trainer.data.dataset import template_options

    tokenizer = load_target_tokenizer(config)
    samples, report = tokenize_file(
        config.data.path, fmt, tokenizer, template_options(config.data), limit=lines
    )
    if report.dropped:
        first = report.dropped[0]
        raise fail(
            "data.path",
            f"{first.where}: {first.why}",
            "Fix that line, or the chat template options (data.enable_thinking, "
            "data.system_prompt); docs/training.md, 'Data'.",
        )
    return samples


def load_target_tokenizer(config: TrainConfig) -> Any:
    from trainer.data.chat import load_tokenizer

    folder = config.model.target
    hint = (
        "Chat and text data are tokenized with the target's own tokenizer: copy its "
        "tokenizer files (tokenizer.json, tokenizer_config.json) into model.target, or "
        "give tokenized JSONL (python -m trainer tokenize)."
    )
    try:
        tokenizer = load_tokenizer(folder)
    except Exception as exc:  # transformers raises OSError, ValueError, … for a bad folder
        why = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
        raise fail(
            "model.target",
            f"the tokenizer in {folder} does not load ({type(exc).__name__}: {why})",
            hint,
        ) from exc
    if len(tokenizer) < 2:  # transformers builds an empty one when the files are missing
        raise fail("model.target", f"the tokenizer in {folder} does not load (no vocabulary)", hint)
    return tokenizer


def check_eval(config: TrainConfig) -> str:
    prompts = config.eval.prompts
    if not prompts:
        return ""
    if not Path(prompts).is_file():
        raise fail(
            "eval.prompts",
            f"{prompts} does not exist",
            "Set eval.prompts to a JSONL file of prompts, or leave it empty to use data.holdout.",
        )
    return f"eval prompts {prompts}"


def _message(exc: TrainConfigError) -> str:
    """The message without its key prefix and without the hint `str()` appends."""
    return str(exc.args[0]).removeprefix(f"{exc.key}: ")


# ---- running it ------------------------------------------------------------------------------


def run_checks(
    config: TrainConfig, *, lines: int = DEFAULT_LINES
) -> tuple[list[str], list[Problem]]:
    """(summary lines, problems): every part is checked; with a bad target the data's lines
    are parsed but not rendered (the tokenizer and the vocabulary come from the target)."""
    if config.demo.enabled:
        return ["demo: the run builds its own tiny target and data (nothing to check)"], []
    summary: list[str] = []
    problems: list[Problem] = []

    def part(check: Callable[[], str]) -> bool:
        try:
            line = check()
        except CheckFailed as exc:
            problems.append(exc.problem)
            return False
        if line:
            summary.append(line)
        return True

    target_ok = part(lambda: check_target(config))
    if target_ok:
        part(lambda: check_linear_attention(config))
    part(lambda: check_data(config, lines=lines, render=target_ok))
    part(lambda: check_eval(config))
    return summary, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer check",
        description=__doc__.split("\n")[0],
        parents=[config_options()],
    )
    parser.add_argument("--lines", type=int, default=DEFAULT_LINES, help="data lines to parse")
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
    except TrainConfigError as exc:
        print(f"error: {args.config}: {exc.key}: {_message(exc)}", file=sys.stderr)
        print(f"hint: {exc.hint}", file=sys.stderr)
        return 2
    summary, problems = run_checks(config, lines=args.lines)
    for p in problems:
        print(f"error: {args.config}: {p.key}: {p.message}", file=sys.stderr)
        print(f"hint: {p.hint}", file=sys.stderr)
    if problems:
        return 1
    for line in summary:
        print(f"ok: {line}")
    return 0
