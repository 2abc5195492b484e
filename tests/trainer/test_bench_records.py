"""`bench/records.py`: a run's JSON rewritten one report a line with the same values, and a
run's log folded into its JSON as what a record cites of it."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.records import compact_json, log_summary
from tests.cli_helpers import REPO


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.choice(["dict", "list", "pairs", "scalar"] if depth < 4 else ["scalar"])
    if kind == "dict":
        return {f"k{i}": random_value(rng, depth + 1) for i in range(rng.randint(0, 4))}
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    if kind == "pairs":  # per-prompt counts
        return [[rng.randint(100, 140), rng.randint(0, 90)] for _ in range(rng.randint(1, 40))]
    return rng.choice([rng.random(), rng.randint(-5, 10**9), "τ 2.6 — x", None, True, 1e-300])


def test_compact_json_keeps_every_value_and_puts_a_report_on_one_line() -> None:
    rng = random.Random(0)
    for _ in range(300):
        value = random_value(rng)
        assert json.loads(compact_json(value)) == value
    report = {"tau": 2.6016518, "prompt_counts": [[127, 65]] * 128, "lossless": True}
    result = {"points": [{"samples": 8, "held_out": report}], "held_out": report}
    text = compact_json(result)
    assert json.loads(text) == result
    lines = text.splitlines()
    assert sum(json.dumps(report["prompt_counts"]) in line for line in lines) == 2
    assert len(lines) == 9  # {, points: [, {, samples, held_out, }, ], held_out, }
    log = {"kept": [f"[06:18:2{i}] a log line that is long enough to need one of its own" for i in
                    range(3)]}  # fmt: skip
    assert len(compact_json(log).splitlines()) == 4 + 3  # one string a line past 100 characters


STEP = "[06:19:{s:02d}] step {n}/{total} | loss 3.7 ce 3.8 kl 3.0 cap -0.06 | acc% 44 32 24 | {tau}{rate} tok/s | lr 1.81e-03 | gnorm 0.26"  # noqa: E501


def step(n: int, total: int, rate: str, tau: str = "") -> str:
    return STEP.format(s=n % 60, n=n, total=total, rate=rate, tau=tau)


def test_a_log_keeps_what_a_record_cites() -> None:
    """Progress bars, warnings, the printed JSON and the steps between a run's first and last
    that carry no τ probe go; each training's tokens/s range past its first (compiling) step
    stays, and the target's last logged loss."""
    probe = "tau 2.87 (train 1.97, lookup 1.31) | "
    lines = [
        "[06:13:13] corpus: 391 training files (7.7 MB), 534 kept from the target",
        "[06:13:32] target step 100 loss 3.993",
        "[06:14:49] target step 1700 loss 0.134",
        "Loading weights:   0%|          | 0/91 [00:00<?, ?it/s]",
        "generate [###.................] 11/61 shards | 44,801 samples | 240,623 tok/s",
        "generated 247,990 samples, 43,131,455 answer tokens in 0:02:49 (254,176 tok/s)",
        "/opt/x/compile_fx.py:322: UserWarning: TensorFloat32 tensor cores",
        "  warnings.warn(",
        step(30, 600, "19,284"),
        step(60, 600, "503,066"),
        "[06:19:49] epoch 2 begins: the drafter now sees repeated samples",
        step(150, 600, "341,927", probe),
        step(180, 600, "511,501"),
        step(600, 600, "480,032"),
        "[06:20:24] checkpoint step-00000600",
        step(290, 5813, "503,306"),
        step(1453, 5813, "415,493", probe),
        step(5813, 5813, "332,704"),
        "[06:28:27] tau 2.785 (95% 2.43–3.27) | accept% by slot 62 38 25 | lossless",
        "{",
        '  "samples": 247990',
        "}",
    ]
    summary = log_summary("\n".join(lines) + "\n", "eval.log")
    assert summary["file"] == "eval.log" and summary["lines"] == len(lines)
    assert summary["bytes"] == len(("\n".join(lines) + "\n").encode())
    assert summary["trainings_tokens_per_s"] == [[341_927, 511_501], [332_704, 415_493]]
    assert summary["kept"] == [lines[i] for i in (0, 2, 5, 8, 10, 11, 13, 14, 15, 16, 17, 18)]


def test_summarize_folds_a_log_into_its_json_or_a_new_one(tmp_path: Path) -> None:
    (tmp_path / "base.json").write_text(json.dumps({"points": [{"samples": 8}]}, indent=2))
    (tmp_path / "base.log").write_text("[06:13:13] corpus: 1 file\n")
    (tmp_path / "prepare.log").write_text("[06:13:13] corpus: 2 files\n")
    run = subprocess.run(
        [sys.executable, str(REPO / "bench" / "records.py"), "summarize",
         str(tmp_path / "base.log"), str(tmp_path / "prepare.log")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base.json", "prepare.json"]
    base = json.loads((tmp_path / "base.json").read_text())
    assert base["points"] == [{"samples": 8}]
    assert base["log"]["kept"] == ["[06:13:13] corpus: 1 file"]
    assert json.loads((tmp_path / "prepare.json").read_text())["log"]["file"] == "prepare.log"
    missing = subprocess.run(
        [sys.executable, str(REPO / "bench" / "records.py"), "summarize", str(tmp_path / "x.log")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert missing.returncode == 2 and "x.log: no such file" in missing.stderr


RESULTS = REPO / "bench" / "results"


def tracked(*patterns: str) -> list[Path]:
    """The repository's files git tracks (or would: untracked, not ignored) matching `patterns`."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", *patterns],
        capture_output=True, text=True, cwd=REPO, check=True,
    )  # fmt: skip
    return [REPO / line for line in listed.stdout.splitlines() if (REPO / line).is_file()]


def test_every_record_has_a_readme_and_keeps_no_raw_log_over_50_kb() -> None:
    records = [p for p in RESULTS.iterdir() if p.is_dir()]
    assert len(records) >= 20
    for record in records:
        readme = (record / "README.md").read_text()
        assert readme.startswith("# "), record
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", readme), f"{record}: no date in its README"
        assert "**Finding.**" in readme, record
    for path in tracked("bench/results"):
        assert path.stat().st_size <= 50_000, path
        if path.suffix == ".json":
            json.loads(path.read_text())


def test_every_record_the_repository_names_exists() -> None:
    named = re.compile(r"bench/results/[a-z0-9][a-z0-9._/-]*[a-z0-9/]")
    for path in tracked("*.md", "*.py", "*.toml", "*.sh"):
        for found in named.findall(path.read_text(errors="replace")):
            assert (REPO / found).exists(), f"{path.relative_to(REPO)} names {found}"


def anchor(heading: str) -> str:
    """The fragment a markdown viewer gives a heading (GitHub's rule)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_in_the_docs_lead_somewhere() -> None:
    """Every relative `[text](path#anchor)` in a tracked markdown file names a file that exists
    and, for a markdown file, a heading it has."""
    link = re.compile(r"\]\(([^)\s]+)\)")
    for doc in tracked("*.md"):
        for target in link.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, fragment = target.partition("#")
            where = (doc.parent / path).resolve() if path else doc
            assert where.exists(), f"{doc.relative_to(REPO)}: {target}"
            if fragment and where.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", where.read_text(), re.M)
                assert fragment in {anchor(h) for h in headings}, (
                    f"{doc.relative_to(REPO)}: {target}"
                )
