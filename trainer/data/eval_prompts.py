"""The prompts a drafter is judged on, from the training JSONL formats: a tokenized line gives
its unsupervised prefix, a chat line the conversation before its last assistant turn, rendered
with the target's chat template (`trainer.evaluation.evaluate`, the τ probe of `trainer.run.probe`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.base.errors import TrainerError
from trainer.data.chat import DEFAULT_TEMPLATE, TemplateOptions, load_tokenizer, render
from trainer.data.dataset import Sample
from trainer.data.formats import DataFileError, numbered_lines, parse_messages, parse_tokenized


class PromptFileError(TrainerError, ValueError):
    """A prompt file line is not in one of the training JSONL formats."""

    hint = (
        'Each line: {"input_ids": [...], "loss_mask": [...]} (the prompt is the unsupervised '
        'prefix) or {"messages": [{"role": ..., "content": ...}, ...]}.'
    )


def prompt_of_sample(sample: Sample) -> list[int]:
    """The unsupervised prefix of a tokenized sample: what the model was given, not trained on."""
    end = next((i for i, m in enumerate(sample.loss_mask) if m), len(sample.loss_mask))
    return sample.input_ids[:end]


def load_prompts(
    path: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    limit: int | None = None,
    template: TemplateOptions = DEFAULT_TEMPLATE,
) -> list[list[int]]:
    """Prompts from the training JSONL formats: tokenized lines give their unsupervised prefix;
    chat lines give the conversation up to (without) the last assistant turn, rendered with the
    target's chat template, the training data's template options and the generation prompt
    (needs `tokenizer_dir`)."""
    prompts: list[list[int]] = []
    tokenizer = None
    try:
        lines = list(numbered_lines(Path(path)))
    except DataFileError as exc:  # not UTF-8, unreadable: said without the data.path key
        raise PromptFileError(str(exc).removeprefix(f"{exc.key}: ")) from exc
    for lineno, text in lines:
        where = f"{path}:{lineno}"
        try:
            row = json.loads(text)
            if isinstance(row, dict) and "input_ids" in row:
                # no loss_mask: the whole line is the prompt
                row.setdefault("loss_mask", [0] * len(row["input_ids"]))
                prompt = prompt_of_sample(parse_tokenized(row))
            elif isinstance(row, dict) and "messages" in row:
                messages = parse_messages(row)
                if tokenizer is None:
                    tokenizer = _tokenizer(tokenizer_dir, where)
                prompt = _chat_prompt(tokenizer, messages, template)
            else:
                raise PromptFileError(f"{where}: expected input_ids or messages")
        except json.JSONDecodeError as exc:
            raise PromptFileError(f"{where}: not JSON ({exc})") from exc
        except (ValueError, TypeError) as exc:
            if isinstance(exc, PromptFileError):
                raise
            raise PromptFileError(f"{where}: {exc}") from exc
        if not prompt:
            raise PromptFileError(f"{where}: empty prompt (the first token is supervised)")
        prompts.append(prompt)
        if limit is not None and len(prompts) >= limit:
            break
    if not prompts:
        raise PromptFileError(f"{path}: no prompts")
    return prompts


def _tokenizer(folder: str | Path | None, where: str) -> Any:
    if folder is None:
        raise PromptFileError(f"{where}: chat prompts need the target's tokenizer folder")
    return load_tokenizer(folder)


def _chat_prompt(
    tokenizer: Any, messages: list[dict[str, str]], template: TemplateOptions
) -> list[int]:
    if messages and messages[-1].get("role") == "assistant":
        messages = messages[:-1]
    return render(tokenizer, template.messages(messages), template, prompt=True)
