"""`dflash generate` end to end on this machine: the generation runs as the job in tmux (seen by
`logs --follow` and `status`), writes complete shards, and a restart resumes it without redoing
them; paths it cannot use are refused before anything is deployed."""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_helpers import REPO, dflash, kill_tmux_server

TRAIN = """
[train]
demo = { enabled = true, num_samples = 8, num_layers = 2, prompt_len = 6, gen_len = 8 }
data = { max_len = 64 }
run = { device = "cpu", threads = 1 }
"""


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    (tmp_path / "deploy.toml").write_text(f'[job]\nsocket = "{socket}"\nstop_timeout = 3\n{TRAIN}')
    shutil.copytree(
        REPO / "trainer", tmp_path / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    lines = [json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) for i in range(6)]
    (tmp_path / "prompts.jsonl").write_text("\n".join([*lines, "{bad"]) + "\n")
    try:
        yield tmp_path
    finally:
        kill_tmux_server(socket)


def test_generate_runs_as_the_job_and_a_restart_resumes(project: Path) -> None:
    out = project / "gen"
    started = dflash(project, "generate", "--prompts", str(project / "prompts.jsonl"),
                     "--out", str(out), "--max-new-tokens", "6", "--shard-size", "2",
                     "--engine", "static", "--temperature", "1", "--sampled-prefix", "2")  # fmt: skip
    assert started.returncode == 0, started.stderr
    followed = dflash(project, "logs", "--follow", timeout=300)
    assert followed.returncode == 0, followed.stdout[-2000:]
    assert f"skipped {project / 'prompts.jsonl'}:7: not JSON" in followed.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] and manifest["counts"]["samples"] == 6
    assert manifest["sampling"]["sampled_prefix"] == 2 and manifest["sampling"]["temperature"] == 1
    status = json.loads(dflash(project, "status", "--json").stdout)
    assert status["exit_code"] == 0 and any("done:" in line for line in status["last_lines"])
    shards = {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.bin")}
    assert len(shards) == 3
    assert dflash(project, "restart").returncode == 0
    again = dflash(project, "logs", "--follow", timeout=300)
    assert again.returncode == 0 and "3 finished already, 0 to generate" in again.stdout
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("shard-*.bin")} == shards


def test_paths_it_cannot_use_are_refused(project: Path) -> None:
    inside = project / ".dflash" / "local" / "checkpoints" / "gen"
    refused = dflash(
        project, "generate", "--prompts", str(project / "prompts.jsonl"), "--out", str(inside)
    )
    assert refused.returncode == 1 and "inside the checkpoints folder" in refused.stderr
    missing = dflash(
        project, "generate", "--prompts", str(project / "nope.jsonl"), "--out", "/tmp/x"
    )
    assert missing.returncode == 1 and "nope.jsonl does not exist" in missing.stderr
    relative = dflash(project, "generate", "--prompts", "prompts.jsonl", "--out", "/tmp/x")
    assert relative.returncode == 1 and "absolute" in relative.stderr
    assert not (project / ".dflash" / "local" / "releases").exists()
