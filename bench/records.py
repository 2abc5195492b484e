"""Benchmark records: a run's results made small enough to keep in the tree.

    python bench/records.py compact R/*.json        # the same JSON, one report per line
    python bench/records.py summarize R/*.log       # each log folded into its JSON, then removed

A record (`bench/results/<slug>/`) keeps a README (command, environment, table, finding) and
the run's JSON; the raw logs stay where the run wrote them. `compact` rewrites a JSON file with
every object or list that holds no object on one line (a report of τ, its interval and its
per-prompt counts reads as one line, not hundreds): the values are unchanged. `summarize` keeps
of a `bench_eval.py` or trainer log what a record cites — every line that is not a progress bar,
a warning, the JSON the run printed at its end (the JSON beside the log holds it), or a training
step between the first and the last of its run that carries no τ probe — plus each drafter
training's range of tokens/s, and writes that summary under `"log"` in the JSON of the same name
(created where the run wrote none, e.g. `prepare.log`).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

STEP = re.compile(r"^(?:\[[\d:]+\] )?step (\d+)/(\d+) \|")
TARGET_STEP = re.compile(r"^(?:\[[\d:]+\] )?target step \d+ loss")
RATE = re.compile(r"\| ([\d,]+) tok/s \|")
LINE = 100  # characters: a list of strings past this is one string a line
NOISE = ("it/s]", "s/it]", "UserWarning", "warnings.warn(", "generate [")


def compact_json(value: Any, indent: int = 0) -> str:
    """JSON text with every container that holds no object on one line, the rest indented
    (a list of strings longer than a line, such as a log's lines, one string a line)."""
    if one_line(value):
        return json.dumps(value, ensure_ascii=False)
    pad, inner = " " * indent, " " * (indent + 2)
    if isinstance(value, dict):
        items = [
            f"{inner}{json.dumps(k, ensure_ascii=False)}: {compact_json(v, indent + 2)}"
            for k, v in value.items()
        ]
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    items = [f"{inner}{compact_json(v, indent + 2)}" for v in value]
    return "[\n" + ",\n".join(items) + f"\n{pad}]"


def long_strings(value: Any) -> bool:
    """Whether `value` is a list of strings that would not fit one line."""
    return (
        isinstance(value, list)
        and any(isinstance(v, str) for v in value)
        and len(json.dumps(value, ensure_ascii=False)) > LINE
    )


def one_line(value: Any) -> bool:
    """Whether `value` holds no object (dict) and no list of strings longer than a line."""
    if long_strings(value):
        return False
    inside = value.values() if isinstance(value, dict) else value if isinstance(value, list) else []
    return all(not isinstance(v, dict) and one_line(v) for v in inside)


def write_json(path: Path | str, value: Any) -> None:
    """`value` at `path` as `compact_json`, ending in a newline (values JSON does not know, such
    as paths, as their `str`)."""
    Path(path).write_text(compact_json(json.loads(json.dumps(value, default=str))) + "\n")


def log_summary(text: str, name: str) -> dict[str, Any]:
    """What a record keeps of a log: see the module's docstring."""
    lines = text.splitlines()
    end = next((i for i, line in enumerate(lines) if line == "{"), len(lines))
    body = [line for line in lines[:end] if line and not any(mark in line for mark in NOISE)]
    runs = training_runs(body)
    kept, rates = [], [[] for _ in set(runs.values())]
    for i, line in enumerate(body):
        if i in runs:
            run, first, last = runs[i]
            rate = RATE.search(line)
            if rate and not first:  # the first logged step of a run pays the compiles
                rates[run].append(int(rate[1].replace(",", "")))
            if first or last or "tau " in line:
                kept.append(line)
        elif not (TARGET_STEP.match(line) and i + 1 < len(body) and TARGET_STEP.match(body[i + 1])):
            kept.append(line)  # of the target's training, its last line
    summary: dict[str, Any] = {"file": name, "lines": len(lines), "bytes": len(text.encode())}
    summary["trainings_tokens_per_s"] = [[min(r), max(r)] for r in rates if r]
    summary["kept"] = kept
    return summary


def training_runs(lines: list[str]) -> dict[int, tuple[int, bool, bool]]:
    """Each trainer step line's index → (its run, first of it, last of it); a run ends where
    the next step line counts to another total or does not count up."""
    steps = [(i, int(m[1]), int(m[2])) for i, line in enumerate(lines) if (m := STEP.match(line))]
    runs: dict[int, tuple[int, bool, bool]] = {}
    run = -1
    for k, (i, step, total) in enumerate(steps):
        before = steps[k - 1] if k else None
        after = steps[k + 1] if k + 1 < len(steps) else None
        first = before is None or before[2] != total or before[1] >= step
        last = after is None or after[2] != total or after[1] <= step
        run += first
        runs[i] = (run, first, last)
    return runs


def summarize(log: Path) -> Path:
    """Fold `log` into the JSON of the same name beside it (see `log_summary`) and remove it."""
    target = log.with_suffix(".json")
    result = json.loads(target.read_text()) if target.is_file() else {}
    result["log"] = log_summary(log.read_text(errors="replace"), log.name)
    write_json(target, result)
    log.unlink()
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("compact", help="rewrite JSON files compactly").add_argument(
        "files", nargs="+", type=Path, help="JSON files, rewritten in place"
    )
    sub.add_parser("summarize", help="fold logs into their JSON").add_argument(
        "files", nargs="+", type=Path, help="logs: each into the .json of its name, then removed"
    )
    args = p.parse_args(argv)
    for path in args.files:
        if not path.is_file():
            p.error(f"{path}: no such file")
        if args.command == "compact":
            write_json(path, json.loads(path.read_text()))
        else:
            print(summarize(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
