"""The data files `data.path` may name, how one is recognised, and how its lines are parsed.

Torch-free on purpose: `trainer.commands.check` runs these very parsers at the place before anything
heavy is imported, so a bad line fails the deploy with the words the loader would use.

JSONL formats (one object per line; the first non-empty line decides the format):
- tokenized — `{"input_ids": [...], "loss_mask": [...]}`: trained on as is;
- chat — `{"messages": [{"role": ..., "content": ...}, ...]}`: rendered with the target's chat
  template, supervised on the assistant turns (`trainer.data.chat`);
- text — `{"text": "..."}`: tokenized with the target's tokenizer, supervised everywhere.

`detect(path)` is the one place a format is chosen: another kind of source (e.g. a folder of
token shards) is one more branch there and one more `Format`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.settings.config import TrainConfigError

FORMAT_KEYS = "'input_ids' (tokenized), 'messages' (chat) or 'text'"


class DataFileError(TrainConfigError):
    """`data.path` is missing, unreadable, or its lines are not in a supported format."""

    hint = (
        "Fix the file or point data.path at another one. Supported: JSONL lines with "
        f"{FORMAT_KEYS}; see docs/training.md, 'Data'."
    )

    def __init__(self, message: str, *, key: str = "data.path") -> None:
        super().__init__(key, message)


@dataclass(frozen=True)
class Sample:
    input_ids: list[int]
    loss_mask: list[bool]


@dataclass(frozen=True, kw_only=True)
class Format:
    """One kind of line: the key that marks it, its parser (row → record, raises ValueError,
    KeyError or TypeError with the reason), and whether it needs the target's tokenizer."""

    name: str
    key: str
    parse: Callable[[Any], Any]
    needs_tokenizer: bool


def parse_tokenized(row: Any) -> Sample:
    ids, mask = row["input_ids"], row["loss_mask"]
    if not isinstance(ids, list) or not isinstance(mask, list):
        raise TypeError("input_ids and loss_mask must be lists")
    if len(ids) != len(mask):
        raise ValueError(f"input_ids ({len(ids)}) and loss_mask ({len(mask)}) differ in length")
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError("input_ids must be integers ≥ 0")
    return Sample([int(i) for i in ids], [bool(m) for m in mask])


def parse_messages(row: Any) -> list[dict[str, Any]]:
    """A conversation: a non-empty list of turns, each with a string role and content."""
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}] has no 'role'")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}] ({m['role']}) has no string 'content'")
    return messages


def parse_chat(row: Any) -> list[dict[str, Any]]:
    """A conversation to train on: it needs an assistant turn (what is supervised)."""
    messages = parse_messages(row)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant turn: nothing to supervise")
    return messages


def parse_text(row: Any) -> str:
    text = row["text"]
    if not isinstance(text, str) or not text.strip():
        raise ValueError("'text' must be a non-empty string")
    return text


TOKENIZED = Format(name="tokenized", key="input_ids", parse=parse_tokenized, needs_tokenizer=False)
CHAT = Format(name="chat", key="messages", parse=parse_chat, needs_tokenizer=True)
TEXT = Format(name="text", key="text", parse=parse_text, needs_tokenizer=True)
FORMATS = (TOKENIZED, CHAT, TEXT)


def detect(path: str | Path) -> Format:
    """The format of `path`, from what it is and its first non-empty line."""
    p = Path(path)
    if not p.exists():
        raise DataFileError(f"{p} does not exist")
    if p.is_dir():
        raise DataFileError(f"{p} is a folder; expected a JSONL file")
    for lineno, text in numbered_lines(p):
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataFileError(f"{p}:{lineno}: not JSON ({exc})") from exc
        for fmt in FORMATS:
            if isinstance(row, dict) and fmt.key in row:
                return fmt
        keys = sorted(row) if isinstance(row, dict) else type(row).__name__
        raise DataFileError(f"{p}:{lineno}: expected a JSON object with {FORMAT_KEYS}; got {keys}")
    raise DataFileError(f"{p} is empty")


def numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of every non-empty line."""
    try:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if line.strip():
                    yield lineno, line
    except UnicodeDecodeError as exc:
        raise DataFileError(f"{path}: not UTF-8 text ({exc})") from exc
    except OSError as exc:
        raise DataFileError(f"{path}: cannot be read ({exc.strerror or exc})") from exc


@dataclass(frozen=True)
class Dropped:
    where: str  # file:line
    why: str


def records(path: str | Path, fmt: Format) -> Iterator[tuple[str, Any]]:
    """(file:line, record) per line; a line that does not parse gives a `Dropped` record."""
    for lineno, text in numbered_lines(Path(path)):
        where = f"{path}:{lineno}"
        try:
            yield where, fmt.parse(json.loads(text))
        except json.JSONDecodeError as exc:
            yield where, Dropped(where, f"not JSON ({exc})")
        except KeyError as exc:
            yield where, Dropped(where, f"a {fmt.name} line needs the key {exc}")
        except (ValueError, TypeError) as exc:
            yield where, Dropped(where, str(exc))


def check_head(path: str | Path, *, lines: int = 20) -> tuple[Format, list[Any]]:
    """The format and the parsed first `lines` records; any bad one among them raises, naming
    its file:line (the strict pre-flight twin of the loader's drop-and-report)."""
    fmt = detect(path)
    head = []
    for _, record in records(path, fmt):
        if isinstance(record, Dropped):
            raise DataFileError(f"{record.where}: {record.why}")
        head.append(record)
        if len(head) >= lines:
            break
    return fmt, head


@dataclass
class DataReport:
    """What loading `data.path` found, logged before training starts."""

    path: str
    format: str
    samples: int = 0
    supervised: int = 0  # supervised tokens after truncation
    truncated: int = 0
    max_len: int | None = None
    per_turn: int = 0  # conversations rendered one sample per assistant turn
    dropped: list[Dropped] = field(default_factory=list)
    cache: str = ""  # "reused <file>" or "wrote <file>"

    def lines(self, *, show: int = 10) -> list[str]:
        cut = f" at data.max_len = {self.max_len}" if self.max_len else ""
        out = [
            f"data {self.path} ({self.format}): {self.samples} samples, "
            f"{self.supervised:,} supervised tokens, {self.truncated} truncated{cut}, "
            f"{len(self.dropped)} lines dropped"
        ]
        if self.cache:
            out.append(f"data cache: {self.cache}")
        if self.per_turn:
            out.append(
                f"data: {self.per_turn} conversations rendered one sample per assistant turn "
                "(the chat template does not render earlier turns as a prefix)"
            )
        out += [f"dropped {d.where}: {d.why}" for d in self.dropped[:show]]
        if len(self.dropped) > show:
            out.append(f"dropped {len(self.dropped) - show} more lines")
        return out


def truncate(samples: Sequence[Sample], report: DataReport, max_len: int | None) -> list[Sample]:
    """Samples cut to `max_len`, counted in `report` (truncated, supervised tokens)."""
    out = []
    report.max_len = max_len
    for s in samples:
        if max_len is not None and len(s.input_ids) > max_len:
            s = Sample(s.input_ids[:max_len], s.loss_mask[:max_len])
            report.truncated += 1
        report.supervised += sum(s.loss_mask)
        out.append(s)
    report.samples = len(out)
    return out


def read_tokenized(path: str | Path) -> tuple[list[Sample], DataReport]:
    report = DataReport(path=str(path), format=TOKENIZED.name)
    samples = []
    for _, record in records(path, TOKENIZED):
        if isinstance(record, Dropped):
            report.dropped.append(record)
        else:
            samples.append(record)
    return samples, report


def write_samples(path: str | Path, samples: Sequence[Sample]) -> None:
    with open(path, "w") as fh:
        for s in samples:
            fh.write(
                json.dumps({"input_ids": s.input_ids, "loss_mask": [int(m) for m in s.loss_mask]})
            )
            fh.write("\n")
