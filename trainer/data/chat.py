"""Chat and text data → tokenized samples with the target's own tokenizer and chat template,
cached next to the checkpoints so that the tokenizing happens once.

A conversation is one sample whose assistant turns are supervised when the template renders
every prefix of it as a prefix of the whole. Templates that rewrite earlier turns (e.g. strip
`<think>…</think>` from assistant turns before the last user message) are not prefix-stable:
such a conversation becomes one sample per assistant turn — the conversation up to and
including that turn, supervised on that turn only — so every turn is trained as the template
renders it when that turn is the one being generated.

The cache (`<cache_dir>/<stem>-<key>.jsonl`, tokenized JSONL, and `.report.json` beside it) is
keyed on the source's size and content hash (re-read only when its size or mtime changed), the
tokenizer's files and the template options; any change writes a new one. Concurrent ranks take
a file lock: one tokenizes, the others read what it wrote.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainer.data.formats import (
    CHAT,
    DataReport,
    Dropped,
    Format,
    Sample,
    read_tokenized,
    records,
    write_samples,
)

CACHE_VERSION = 1
# Files of a save_pretrained folder that shape tokenizing (weights and config.json do not).
_TOKENIZER_FILES = (
    "tokenizer",
    "special_tokens_map",
    "added_tokens",
    "vocab",
    "merges",
    "chat_template",
)
_TOKENIZER_EXTS = (".model", ".tiktoken")


@dataclass(frozen=True, kw_only=True)
class TemplateOptions:
    """`[train.data]` options of the chat template."""

    enable_thinking: bool | None = None  # None: the template's own default
    system_prompt: str = ""  # added as the first message to conversations without one

    def kwargs(self) -> dict[str, Any]:
        return {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}

    def messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.system_prompt and messages[0].get("role") != "system":
            return [{"role": "system", "content": self.system_prompt}, *messages]
        return messages


DEFAULT_TEMPLATE = TemplateOptions()


def load_tokenizer(folder: str | Path) -> Any:
    """The target's tokenizer from its local folder (never the hub)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)


def render(
    tokenizer: Any, messages: list[dict[str, Any]], options: TemplateOptions, *, prompt: bool
) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=prompt, **options.kwargs()
    )
    if hasattr(out, "keys") and "input_ids" in out:
        out = out["input_ids"]
    return [int(t) for t in out]


def tokenize_chat(
    tokenizer: Any, messages: list[dict[str, Any]], options: TemplateOptions = DEFAULT_TEMPLATE
) -> tuple[list[Sample], bool]:
    """→ (samples, per_turn). One sample supervised on every assistant turn when the template is
    prefix-stable for this conversation; else one sample per assistant turn. Raises ValueError
    when an assistant turn cannot be located even on its own (the template changes the prompt
    it was generated from)."""
    messages = options.messages(messages)
    turns = []  # (prompt tokens, prompt + turn tokens) per assistant turn
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = render(tokenizer, messages[:i], options, prompt=True)
        upto = render(tokenizer, messages[: i + 1], options, prompt=False)
        if upto[: len(before)] != before:
            raise ValueError(
                f"assistant turn {i}: the template renders the conversation up to it differently "
                "from its generation prompt; the turn cannot be located"
            )
        turns.append((before, upto))
    full = render(tokenizer, messages, options, prompt=False)
    if all(full[: len(upto)] == upto for _, upto in turns):
        mask = [False] * len(full)
        for before, upto in turns:
            mask[len(before) : len(upto)] = [True] * (len(upto) - len(before))
        return [Sample(full, mask)], False
    samples = [
        Sample(upto, [False] * len(before) + [True] * (len(upto) - len(before)))
        for before, upto in turns
    ]
    return samples, True


def tokenize_text(tokenizer: Any, text: str) -> Sample:
    """Raw text, every token supervised (the first one has no context: it is never an anchor's
    label either way)."""
    ids = [int(t) for t in tokenizer(text)["input_ids"]]
    return Sample(ids, [True] * len(ids))


def tokenize_file(
    path: str | Path,
    fmt: Format,
    tokenizer: Any,
    options: TemplateOptions,
    *,
    limit: int | None = None,
) -> tuple[list[Sample], DataReport]:
    """The lines of a chat or text file (the first `limit`) → samples; lines that fail are
    dropped and reported."""
    report = DataReport(path=str(path), format=fmt.name)
    samples: list[Sample] = []
    for n, (where, record) in enumerate(records(path, fmt)):
        if limit is not None and n >= limit:
            break
        if isinstance(record, Dropped):
            report.dropped.append(record)
            continue
        if fmt is not CHAT:
            samples.append(tokenize_text(tokenizer, record))
            continue
        try:
            got, per_turn = tokenize_chat(tokenizer, record, options)
        except Exception as exc:  # the template's own errors (jinja raise_exception, …)
            report.dropped.append(Dropped(where, f"chat template: {type(exc).__name__}: {exc}"))
            continue
        samples += got
        report.per_turn += per_turn
    return samples, report


def cached_samples(
    path: str | Path,
    fmt: Format,
    *,
    tokenizer_dir: str | Path,
    options: TemplateOptions,
    cache_dir: str | Path,
) -> tuple[list[Sample], DataReport]:
    """The samples of `path`, tokenized once into `cache_dir` and read back while the source,
    the tokenizer and the options are unchanged."""
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    key = cache_key(path, fmt, tokenizer_dir, options, cache_dir=cache_dir)
    stem = cache_dir / f"{Path(path).stem}-{key}"
    data, meta = stem.with_suffix(".jsonl"), stem.with_suffix(".report.json")
    with open(stem.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if meta.is_file() and data.is_file():
            report = _report_from(json.loads(meta.read_text()))
            report.cache = f"reused {data}"
            return read_tokenized(data)[0], report
        samples, report = tokenize_file(path, fmt, load_tokenizer(tokenizer_dir), options)
        _write_atomic(data, lambda p: write_samples(p, samples))
        _write_atomic(meta, lambda p: p.write_text(json.dumps(asdict(report))))
        report.cache = f"wrote {data}"
        return samples, report


def cache_key(
    path: str | Path,
    fmt: Format,
    tokenizer_dir: str | Path,
    options: TemplateOptions,
    *,
    cache_dir: Path | None = None,
) -> str:
    """A digest of the source (size and content), the tokenizer's files and the options."""
    h = hashlib.sha256()
    h.update(json.dumps([CACHE_VERSION, fmt.name, asdict(options)]).encode())
    h.update(source_digest(Path(path), cache_dir).encode())
    for f in sorted(Path(tokenizer_dir).iterdir()):
        if f.is_file() and (f.name.startswith(_TOKENIZER_FILES) or f.suffix in _TOKENIZER_EXTS):
            h.update(f.name.encode())
            h.update(_sha256(f).encode())
    return h.hexdigest()[:16]


def source_digest(path: Path, cache_dir: Path | None) -> str:
    """`size:sha256` of the source. A memo in `cache_dir` keyed on the path, size and mtime
    spares re-reading a large file on every start (and on every rank)."""
    stat = path.stat()
    seen = {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    memo = cache_dir / f"{path.stem}.source.json" if cache_dir is not None else None
    if memo is not None and memo.is_file():
        try:
            known = json.loads(memo.read_text())
        except ValueError:
            known = {}
        if {k: known.get(k) for k in seen} == seen and isinstance(known.get("sha256"), str):
            return f"{stat.st_size}:{known['sha256']}"
    digest = _sha256(path)
    if memo is not None:
        _write_atomic(memo, lambda p: p.write_text(json.dumps({**seen, "sha256": digest})))
    return f"{stat.st_size}:{digest}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _write_atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def _report_from(raw: Mapping[str, Any]) -> DataReport:
    fields = dict(raw)
    fields["dropped"] = [Dropped(**d) for d in fields.get("dropped", [])]
    return DataReport(**fields)
