"""Prompt JSONL for `trainer.generation.generate`: read, check, deduplicate, render to token ids.

One prompt per line, one of:
- `{"messages": [{"role": "user", "content": "…"}, …]}` — rendered with the target's chat
  template and the generation prompt; trailing assistant turns are dropped (the target writes
  its own answer), so a chat training file is also a prompt file;
- `{"text": "…"}` — raw text, tokenized as the target's tokenizer does by default;
- `{"input_ids": [1, 2, …]}` — token ids as they are (a `loss_mask`, if present, is ignored).

`scan` reads every file once and keeps only where each unique prompt starts (file, byte offset,
line number), so a prompt file of millions of lines costs little memory; a bad line is named
`file:line` with the reason and skipped, or refused with `strict`. Duplicates (the same field,
same content) keep their first occurrence. `read` fetches one prompt again by its reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.base.errors import TrainerError

KINDS = ("messages", "text", "input_ids")


class PromptLineError(TrainerError, ValueError):
    """A prompt line is not one of the formats; the message names `file:line`."""

    hint = (
        "Fix or remove that line; without --strict, bad lines are skipped and listed in the "
        "manifest."
    )


class NoTokenizer(TrainerError):
    """Chat or text prompts need the target's tokenizer, and its folder has none."""

    hint = "Save the tokenizer beside the target (tokenizer.save_pretrained), or give token ids."


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(frozen=True)
class PromptRef:
    """Where a prompt is: `files[file]`, starting at byte `offset`, on line `lineno`."""

    file: int
    offset: int
    lineno: int


@dataclass
class Scan:
    files: list[str]
    refs: list[PromptRef] = field(default_factory=list)  # unique prompts, first occurrences
    duplicates: int = 0
    bad: list[str] = field(default_factory=list)  # "file:line: why"
    fingerprint: str = ""  # of the unique prompts in order: resume refuses a changed set

    def where(self, ref: PromptRef) -> str:
        return f"{self.files[ref.file]}:{ref.lineno}"


def parse(line: bytes | str) -> tuple[str, Any]:
    """(kind, value) of one prompt line; ValueError saying what is wrong."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise ValueError("expected a JSON object")
    kinds = [k for k in KINDS if k in row]
    if len(kinds) != 1:
        raise ValueError(f"expected exactly one of {', '.join(KINDS)}; got keys {sorted(row)}")
    kind, value = kinds[0], row[kinds[0]]
    if kind == "messages":
        ok = isinstance(value, list) and all(
            isinstance(m, dict)
            and isinstance(m.get("role"), str)
            and isinstance(m.get("content"), str)
            for m in value
        )
        if not ok:
            raise ValueError("messages must be a list of {'role': str, 'content': str}")
        value = _prompt_turns(value)
    elif kind == "text":
        if not isinstance(value, str) or not value:
            raise ValueError("text must be a non-empty string")
    else:
        ok = isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
        )
        if not ok or not value:
            raise ValueError("input_ids must be a non-empty list of token ids (integers ≥ 0)")
    return kind, value


def _prompt_turns(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """The conversation without its trailing assistant turns: what the target answers."""
    end = len(messages)
    while end and messages[end - 1]["role"] == "assistant":
        end -= 1
    if not end:
        raise ValueError("messages hold no turn before the assistant's (nothing to answer)")
    return [{"role": m["role"], "content": m["content"]} for m in messages[:end]]


def _key(kind: str, value: Any) -> bytes:
    blob = json.dumps([kind, value], sort_keys=True, ensure_ascii=False).encode()
    return hashlib.blake2b(blob, digest_size=16).digest()


def scan(paths: Sequence[str | Path], *, strict: bool = False) -> Scan:
    """Check every line of every file; keep the first occurrence of each prompt."""
    result = Scan(files=[str(p) for p in paths])
    seen: set[bytes] = set()
    digest = hashlib.sha256()
    for f, path in enumerate(result.files):
        if not Path(path).is_file():
            raise PromptLineError(
                f"{path}: no such prompt file", hint="Pass an existing JSONL file with --prompts."
            )
        with open(path, "rb") as fh:
            offset = 0
            for lineno, line in enumerate(fh, 1):
                start, offset = offset, offset + len(line)
                if not line.strip():
                    continue
                try:
                    key = _key(*parse(line))
                except ValueError as exc:
                    where = f"{path}:{lineno}: {exc}"
                    if strict:
                        raise PromptLineError(where) from exc
                    result.bad.append(where)
                    continue
                if key in seen:
                    result.duplicates += 1
                    continue
                seen.add(key)
                digest.update(key)
                result.refs.append(PromptRef(f, start, lineno))
    result.fingerprint = digest.hexdigest()[:16]
    return result


def read(scan_result: Scan, ref: PromptRef) -> tuple[str, Any]:
    """The prompt at `ref`, parsed again (it was valid when scanned)."""
    with open(scan_result.files[ref.file], "rb") as fh:
        fh.seek(ref.offset)
        return parse(fh.readline())


class Renderer:
    """Prompt → token ids with the target's tokenizer (loaded only when a prompt needs it)."""

    def __init__(self, tokenizer_dir: str | Path, *, enable_thinking: bool | None = None) -> None:
        self.tokenizer_dir = str(tokenizer_dir)
        self.enable_thinking = enable_thinking
        self._tokenizer: Any = None

    @property
    def has_tokenizer(self) -> bool:
        """Tokenizer files in the folder (without them `transformers` may build an empty
        tokenizer of the model type, whose ids mean nothing)."""
        folder = Path(self.tokenizer_dir)
        return any((folder / name).is_file() for name in TOKENIZER_FILES)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            if not self.has_tokenizer:
                raise NoTokenizer(
                    f"{self.tokenizer_dir} has no tokenizer (none of {', '.join(TOKENIZER_FILES)})"
                )

            self._tokenizer = AutoTokenizer.from_pretrained(
                self.tokenizer_dir, local_files_only=True
            )
        return self._tokenizer

    @property
    def template_has_thinking(self) -> bool:
        if not self.has_tokenizer:
            return False
        return "enable_thinking" in (getattr(self.tokenizer, "chat_template", None) or "")

    def __call__(self, kind: str, value: Any) -> list[int]:
        if kind == "input_ids":
            return [int(t) for t in value]
        if kind == "text":
            return list(self.tokenizer(value)["input_ids"])
        extra = {}
        if self.enable_thinking is not None:
            extra["enable_thinking"] = self.enable_thinking
        out = self.tokenizer.apply_chat_template(
            value, tokenize=True, add_generation_prompt=True, **extra
        )
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return [int(t) for t in out]

    def describe(self) -> dict[str, Any]:
        """What the manifest records about rendering (the template decides serving alignment)."""
        template = None
        if self.has_tokenizer:
            with contextlib.suppress(OSError, ValueError):
                template = getattr(self.tokenizer, "chat_template", None)
        return {
            "tokenizer": self.tokenizer_dir,
            "chat_template_sha256": (
                hashlib.sha256(template.encode()).hexdigest()[:16]
                if isinstance(template, str)
                else None
            ),
            "enable_thinking": self.enable_thinking,
            "add_generation_prompt": True,
        }
