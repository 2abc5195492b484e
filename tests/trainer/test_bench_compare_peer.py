"""`bench/compare_peer.py --smoke` on the CPU, tiny shapes, every stage in its own process.

Without SpecForge it says so and runs ours alone: training, export, held-out τ beside prompt
lookup, the reference loop, the 8B-shaped (here tiny) drafter step. With SpecForge installed
in a private folder (`tests/trainer/peer_site.py`), the same work folder again (`--resume`:
the target, data and ours' training are reused): SpecForge's own training entry on features
of the same target, its export read into ours, both drafters through this project's evaluator
and through z-lab's reference loop with a paired interval, its drafter step beside ours', and
both exported folders key for key in SpecForge's class with the same block logits."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_helpers import REPO
from tests.trainer.peer_site import FETCH, install, reference_file

SCRIPT = REPO / "bench" / "compare_peer.py"
BLOCK = 4  # the smoke drafter's block size


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One work folder for both runs: the second reuses the first's target and data."""
    return tmp_path_factory.mktemp("compare-peer")


def compare(work: Path, out: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--work", str(work), "--out", str(out), *args],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    return run, json.loads((out / "summary.json").read_text())


def check_ours(summary: dict) -> None:
    ours = summary["ours"]
    assert ours["tokens_per_s"] > 0 and ours["step_s"] > 0 and 0 < ours["mfu"] < 1
    assert 1.0 <= ours["tau"] <= BLOCK and ours["lossless"] is True
    assert 1.0 <= summary["prompt_lookup"]["tau"] <= BLOCK
    step = summary["drafter_step_8b"]["ours"]
    assert step["ok"] and step["tokens_per_s"] > 0 and step["timed"] == 2


@pytest.mark.slow
def test_without_specforge_it_says_so_and_runs_ours_only(work: Path, tmp_path: Path) -> None:
    if importlib.util.find_spec("specforge") is not None:
        pytest.skip("SpecForge is importable here: its absence cannot be shown")
    reference = reference_file()
    extra = ["--reference", str(reference)] if reference else []
    run, summary = compare(work, tmp_path / "out", *extra)
    assert "SpecForge absent (" in run.stdout
    assert summary["measured"].startswith("absent: ")
    check_ours(summary)
    assert summary["specforge"]["tau"] is None and summary["tau_difference"]["value"] is None
    assert not any(name.startswith("specforge-") for name in summary["stages"])
    assert summary["drafter_step_8b"]["specforge"] is None
    statuses = {k: v["status"] for k, v in summary["stages"].items() if k != "specforge"}
    assert set(statuses.values()) == {"done"}, statuses
    assert {d["setting"] for d in summary["differences"]} >= {
        "loss",
        "optimizer",
        "target features",
    }
    assert (tmp_path / "out" / "summary.md").read_text().startswith("# Ours beside SpecForge")
    if reference:  # the reference loop decodes ours alone; its output is the target's greedy one
        row = summary["reference"]["drafters"]["ours"]
        assert summary["reference"]["prompts"] == 2 and row["identical_to_greedy"] == 2
        assert 1.0 <= row["tau"] <= BLOCK


@pytest.mark.slow
def test_with_specforge_both_trainers_run_on_the_same_work(
    work: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    site = install(tmp_path_factory.mktemp("peer-site"))
    if site is None:
        pytest.skip(FETCH)
    reference = reference_file()
    extra = ["--reference", str(reference)] if reference else []
    out = tmp_path_factory.mktemp("out")
    _, summary = compare(work, out, "--resume", "--peer-site", str(site), *extra)
    assert summary["measured"].startswith("its own training entry: specforge train")
    check_ours(summary)
    theirs = summary["specforge"]
    assert theirs["tokens_per_s"] > 0 and 0 < theirs["mfu"] < 1 and theirs["capture_s"] >= 0
    assert 1.0 <= theirs["tau"] <= BLOCK and theirs["lossless"] is True  # its export, in ours
    assert summary["ratios"]["tokens_per_s"] == pytest.approx(
        summary["ours"]["tokens_per_s"] / theirs["tokens_per_s"]
    )
    diff = summary["tau_difference"]
    assert diff["value"] == pytest.approx(summary["ours"]["tau"] - theirs["tau"])
    lo, hi = diff["interval"]
    assert lo <= diff["value"] <= hi and diff["prompts"] == 2
    for name in ("ours", "specforge"):  # both folders mean the same to SpecForge's class
        row = summary["interop"][name]
        assert row["missing_in_folder"] == [] and row["unknown_to_specforge"] == []
        assert row["block_logits_max_rel_diff"] <= 1e-5
    step = summary["drafter_step_8b"]
    assert step["specforge"]["ok"] and step["specforge"]["tokens_per_s"] > 0
    assert step["tokens_per_s_ratio"] > 0
    if reference:
        ref = summary["reference"]
        assert ref["prompts"] == 2
        for name in ("ours", "specforge"):
            assert ref["drafters"][name]["identical_to_greedy"] == 2
        assert ref["tau_difference"]["prompts"] == 2
    stages = summary["stages"]
    assert {stages["prepare"]["status"], stages["ours-train"]["status"]} <= {"reused", "done"}
    assert stages["specforge-train"]["status"] == "done" and "specforge-modules" not in stages


@pytest.mark.slow
def test_when_its_entry_fails_its_modules_train_from_our_data_loop(
    work: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """Its training entry imports accelerate (`specforge.cli._train`): without it the entry
    fails, and its draft model, loss and optimizer train from ours' batches instead."""
    site = install(tmp_path_factory.mktemp("peer-site"), leave_out=("accelerate",))
    if site is None:
        pytest.skip(FETCH)
    if importlib.util.find_spec("accelerate") is not None:
        pytest.skip("accelerate is importable here: the entry would not fail")
    out = tmp_path_factory.mktemp("out")
    _, summary = compare(work, out, "--resume", "--peer-site", str(site))
    measured = summary["measured"]
    assert measured.startswith("its modules (DFlashDraftModel, OnlineDFlashModel, BF16Optimizer)")
    assert "ModuleNotFoundError: No module named 'accelerate'" in measured
    theirs = summary["specforge"]
    assert theirs["tokens_per_s"] > 0 and 1.0 <= theirs["tau"] <= BLOCK  # its folder, in ours
    assert summary["tau_difference"]["prompts"] == 2
    assert summary["stages"]["specforge-modules"]["status"] == "done"
    assert summary["interop"] is None  # measured after its own entry only
