"""`dflash deploy` of a 1 target + 1 drafter split on two real GPUs (torchrun, NCCL, tmux on this
machine), then `dflash status` as the user sees it: one row per GPU from the real `nvidia-smi`,
each with the role and torch memory the trainer's ranks logged, and `dflash stop` leaving no
process behind. The stand-in nvidia-smi of `tests/ops/test_status_gpus.py` covers the same join on
the CPU; this is the check against the real tool and a real split job."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.cli_helpers import REPO, dflash, kill_tmux_server

pytestmark = [
    pytest.mark.gpu2,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"),
    pytest.mark.skipif(shutil.which("tmux") is None, reason="needs tmux"),
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="needs nvidia-smi"),
]

# The demo (tiny random target, data it generated itself) on the GPUs, uncompiled so that the job
# trains within seconds, with steps enough to still run while it is looked at.
CONFIG = """
[job]
socket = "{socket}"
stop_timeout = 20
gpus = 2
target_gpus = 1
env = {{ PYTORCH_CUDA_ALLOC_CONF = "expandable_segments:True" }}

[train]
demo = true

[train.run]
device = "cuda"
steps = 1000000
compile = false
checkpoint_every = 1000000

[train.data]
batch_size = 64
max_len = 256
bucket = 256
num_anchors = 64
"""


@pytest.fixture
def project(tmp_path: Path) -> Iterator[Path]:
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    (tmp_path / "deploy.toml").write_text(CONFIG.format(socket=socket))
    shutil.copytree(
        REPO / "trainer", tmp_path / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    try:
        yield tmp_path
    finally:
        kill_tmux_server(socket)


def wait_for_rows(project: Path, timeout: float = 300) -> dict[str, Any]:
    """`status --json` once the split has logged per-rank metrics for both roles."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        result = dflash(project, "status", "--json")
        assert result.returncode == 0, result.stderr
        report = json.loads(result.stdout)
        assert report["running"], report["last_lines"]
        if report.get("split") and all(g["role"] != "—" for g in report["gpus"][:2]):
            return report
        time.sleep(2)
    pytest.fail(f"no per-rank metrics within {timeout} s")


def trainer_processes(project: Path) -> list[str]:
    """The command lines of this project's trainer processes (its checkpoints are under it)."""
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    return [a for a in ps.stdout.splitlines() if "-m trainer train" in a and str(project) in a]


def test_status_shows_real_gpus_of_a_running_split(project: Path) -> None:
    deployed = dflash(project, "deploy", timeout=120)
    assert deployed.returncode == 0, deployed.stderr
    report = wait_for_rows(project)

    assert report["gpu_note"] is None
    roles = {g["index"]: g for g in report["gpus"]}
    assert (roles[0]["role"], roles[0]["ranks"]) == ("target", [0])
    assert (roles[1]["role"], roles[1]["ranks"]) == ("drafter", [1])
    for gpu in (roles[0], roles[1]):
        assert gpu["mem_total_mib"] > 0 and 0 < gpu["mem_used_mib"] <= gpu["mem_total_mib"]
        assert gpu["util_pct"] is None or 0 <= gpu["util_pct"] <= 100
        assert gpu["mem_gib"] is not None and gpu["mem_gib"] >= 0
    split = report["split"]["roles"]
    assert split["target"]["ranks"] == 1 and split["drafter"]["ranks"] == 1
    assert split["drafter"]["tokens_per_s"] > 0
    batches = report["split"]["batches"]
    assert batches["produced"] >= batches["trained"] > 0

    human = dflash(project, "status")
    assert human.returncode == 0, human.stderr
    table = re.findall(r"^\s*([01])\s+(target|drafter)\s+(\d+)\s+(\d+%|\?)", human.stdout, re.M)
    assert [row[:3] for row in table] == [("0", "target", "0"), ("1", "drafter", "1")], human.stdout

    stopped = dflash(project, "stop", timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    assert trainer_processes(project) == []
