"""An inference engine's per-request acceptance, as a file: what
`python -m trainer evaluate --engine-report FILE` holds against the project's own decoding of the
same prompts (`trainer.evaluation.engine_check`).

JSON Lines, one request per line, every token an id (no text: tokenization cannot differ):

    {"prompt": [ids], "output": [ids], "max_tokens": N,
     "accepted": [a_1, a_2, …], "num_speculative_tokens": K, "eos": [ids]}

- `prompt`: the token ids the engine was given; `output`: the new tokens it returned;
- `max_tokens`: the budget of new tokens the request had;
- `accepted`: per verify step, in order, the draft tokens the engine accepted (0 … K, the bonus
  token not counted: the engine's mean acceptance length is 1 + mean(accepted)); absent or null
  for a run without a drafter (then only the output is compared);
- `num_speculative_tokens`: K, the draft tokens proposed per step (needed with `accepted`);
- `eos`: the token ids that ended a request in the engine; absent or [] when only the budget
  did (`ignore_eos`).

vLLM gives `accepted` per request with `per_request_spec_decode_metrics="detailed"`
(`output.spec_decode_metrics.per_step_accepted`); `python -m trainer vllm-report` writes this
file from vLLM's offline API. Torch-free: the file is read and written where the engine runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.base.errors import TrainerError


class EngineReportError(TrainerError):
    """A line of an engine report is not a request of the format above."""

    hint = (
        'Each line: {"prompt": [ids], "output": [ids], "max_tokens": N, "accepted": [counts], '
        '"num_speculative_tokens": K} (docs/serving.md, "Checking an engine").'
    )


@dataclass(frozen=True)
class EngineRequest:
    """One request as the engine served it."""

    prompt: list[int]
    output: list[int]
    max_tokens: int
    accepted: list[int] | None = None  # per verify step; None: served without a drafter
    num_speculative_tokens: int | None = None
    eos: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "prompt": self.prompt,
            "output": self.output,
            "max_tokens": self.max_tokens,
        }
        if self.accepted is not None:
            row["accepted"] = self.accepted
            row["num_speculative_tokens"] = self.num_speculative_tokens
        if self.eos:
            row["eos"] = list(self.eos)
        return row


def write_report(path: str | Path, requests: Iterable[EngineRequest]) -> Path:
    """The requests as JSON Lines at `path` (replaced whole: written beside it, then renamed)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(json.dumps(r.to_json()) + "\n" for r in requests))
    tmp.replace(path)
    return path


def read_report(path: str | Path) -> list[EngineRequest]:
    """Every request of the report; `EngineReportError` names the first bad line and key."""
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise EngineReportError(f"{path}: cannot be read ({exc})") from exc
    requests = []
    for n, text in enumerate(lines, 1):
        if text.strip():
            requests.append(_request(text, f"{path}:{n}"))
    if not requests:
        raise EngineReportError(f"{path}: no requests")
    ks = {r.num_speculative_tokens or 0 for r in requests if r.accepted is not None}
    if len(ks) > 1:
        raise EngineReportError(
            f"{path}: requests with different num_speculative_tokens {sorted(ks)}"
        )
    return requests


def _request(text: str, where: str) -> EngineRequest:
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EngineReportError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(row, dict):
        raise EngineReportError(f"{where}: not a JSON object")
    prompt, output = _ids(row, "prompt", where), _ids(row, "output", where)
    if not prompt:
        raise EngineReportError(f"{where}: prompt is empty")
    budget = _count(row, "max_tokens", where, least=1)
    if len(output) > budget:
        raise EngineReportError(
            f"{where}: {len(output)} output tokens, more than max_tokens {budget}"
        )
    accepted, k = None, None
    if row.get("accepted") is not None:
        k = _count(row, "num_speculative_tokens", where, least=1)
        accepted = _ids(row, "accepted", where)
        if any(a > k for a in accepted):
            raise EngineReportError(f"{where}: accepted counts above num_speculative_tokens {k}")
    eos = tuple(_ids(row, "eos", where)) if row.get("eos") is not None else ()
    return EngineRequest(prompt, output, budget, accepted, k, eos)


def _ids(row: dict[str, Any], key: str, where: str) -> list[int]:
    value = row.get(key)
    if not isinstance(value, list) or not all(_is_count(v) for v in value):
        raise EngineReportError(f"{where}: {key} must be a list of non-negative integers")
    return list(value)


def _count(row: dict[str, Any], key: str, where: str, *, least: int) -> int:
    value = row.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise EngineReportError(f"{where}: {key} must be an integer ≥ {least}")
    return value


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
