"""`dflash plan` end to end: a tiny CPU demo deployed on this machine; refused while its job runs,
then, stopped, planned at the place through the CLI (and through the loopback SSH host), plus
its error cases."""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli_helpers import REPO, dflash, kill_tmux_server

# A demo long enough to be running whenever the test looks (it is stopped by the test).
TRAIN = """
[train]
demo = { enabled = true, num_samples = 8, num_layers = 2, prompt_len = 6, gen_len = 18 }
model = { num_layers = 1, block_size = 4, num_target_layers = 2 }
data = { batch_size = 8, num_anchors = 8, bucket = 32, max_len = 32, noise = 0.0 }
optim = { lr = 1e-2, warmup_steps = 5, weight_decay = 0.0 }
run = { steps = 100000, checkpoint_every = 100000, device = "cpu", threads = 1, log_every = 1 }
"""
QUICK = ("--steps", "2", "--warmup", "1")
SPLITS = [(1, 3), (2, 2), (3, 1)]


@dataclass
class Deployed:
    project: Path
    root: Path
    checkpoints: Path
    socket: str


def write_config(project: Path, socket: str, extra: str = "") -> None:
    (project / "deploy.toml").write_text(
        f'{extra}\n[job]\nsocket = "{socket}"\nstop_timeout = 3\ngpus = 2\n{TRAIN}'
    )


def wait_for_step(log: Path, timeout: float = 240) -> None:
    """Until the job has logged a step: its demo assets are built and it trains."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if log.is_file() and re.search(r"\bstep \d+/", log.read_text(errors="replace")):
            return
        time.sleep(0.5)
    pytest.fail(f"the job logged no step in {timeout} s")


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    project = tmp_path_factory.mktemp("plan-project")
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    write_config(project, socket)
    shutil.copytree(
        REPO / "trainer", project / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    root = project / ".dflash" / "local"
    try:
        result = dflash(project, "deploy")
        assert result.returncode == 0, result.stderr
        yield Deployed(project, root, root / "checkpoints", socket)
    finally:
        kill_tmux_server(socket)


def ssh_project(deployed: Deployed, folder: Path) -> Path:
    """A second project seeing the same deployment through the loopback SSH host."""
    box = (
        f'[targets.box]\nplace = "ssh"\nhost = "elsewhere"\nroot = "{deployed.root}"\n'
        f'checkpoints = "{deployed.checkpoints}"\npython = "{sys.executable}"\n'
    )
    write_config(folder, deployed.socket, box)
    return folder


def check_table(stdout: str) -> None:
    rows = re.findall(
        r"^\s*(\d+)\s+(\d+)\s+([\d,]+)\s+(target|drafter)(?:  <- ([a-z, ]+))?$", stdout, re.M
    )
    assert [(int(t), int(d)) for t, d, *_ in rows] == SPLITS, stdout
    rates = [float(r[2].replace(",", "")) for r in rows]
    best = [i for i, r in enumerate(rows) if "best" in r[4]]
    assert len(best) == 1 and rates[best[0]] == max(rates)
    # the default of the demo's shapes: its drafter costs more per token than its 2-layer target
    assert [int(r[0]) for r in rows if "default" in r[4]] == [1]
    assert stdout.startswith("target alone:") and "one GPU colocated:" in stdout
    assert "default split from model FLOPs per token at 32 tokens a sequence" in stdout


def check_json(stdout: str) -> None:
    report = json.loads(stdout)
    assert report["gpus"] == 4
    assert [(s["targets"], s["drafters"]) for s in report["splits"]] == SPLITS
    assert report["best"]["tokens_per_s"] == max(s["tokens_per_s"] for s in report["splits"])
    work = report["default_from"]
    assert report["default"]["targets"] == 1 and work["target_flops"] < work["drafter_flops"]
    assert report["rates"]["r_target"] > 0 and report["rates"]["r_drafter"] > 0


def test_plan_refused_while_the_job_runs_then_planned(
    deployed: Deployed, ssh_home: object, tmp_path: Path
) -> None:
    wait_for_step(deployed.checkpoints / "train_stdout.log")
    busy = dflash(deployed.project, "plan", "--gpus", "4", *QUICK)
    assert busy.returncode == 1 and busy.stdout == ""
    assert "is running" in busy.stderr and "dflash stop" in busy.stderr
    assert "--force" in busy.stderr
    remote = ssh_project(deployed, tmp_path)
    over_ssh = dflash(remote, "plan", "--target", "box", "--host", "testbox", *QUICK)
    assert over_ssh.returncode == 1 and "is running" in over_ssh.stderr
    forced = dflash(deployed.project, "plan", "--force", "--gpus", "3", "--json", *QUICK)
    assert forced.returncode == 0, forced.stderr  # timed next to the job, as asked
    assert len(json.loads(forced.stdout)["splits"]) == 2

    stopped = dflash(deployed.project, "stop")
    assert stopped.returncode == 0, stopped.stderr
    table = dflash(deployed.project, "plan", "--gpus", "4", *QUICK)
    assert table.returncode == 0, table.stderr
    check_table(table.stdout)
    as_json = dflash(deployed.project, "plan", "--gpus", "4", "--json", *QUICK)
    assert as_json.returncode == 0, as_json.stderr
    check_json(as_json.stdout)
    default = dflash(deployed.project, "plan", "--json", *QUICK)  # [job] gpus = 2: 1 + 1
    assert default.returncode == 0, default.stderr
    assert [(s["targets"], s["drafters"]) for s in json.loads(default.stdout)["splits"]] == [(1, 1)]

    remote_json = dflash(
        remote, "plan", "--target", "box", "--host", "testbox", "--gpus", "4", "--json", *QUICK
    )
    assert remote_json.returncode == 0, remote_json.stderr
    check_json(remote_json.stdout)


def test_plan_failure_shows_the_planners_error(deployed: Deployed) -> None:
    """A planner that fails (a train.toml it refuses) gives its own last stderr line."""
    stopped = dflash(deployed.project, "stop")
    assert stopped.returncode == 0, stopped.stderr
    config = deployed.root / "current" / "train.toml"
    good = config.read_text()
    config.write_text(good + "\n[nonsense]\nx = 1\n")
    try:
        failed = dflash(deployed.project, "plan", "--gpus", "4", *QUICK)
    finally:
        config.write_text(good)
    assert failed.returncode == 2, failed.stderr
    assert "python -m trainer plan" in failed.stderr and "(exit 2)" in failed.stderr
    assert "nonsense" in failed.stderr and "hint:" in failed.stderr
    assert failed.stdout == ""


def test_plan_without_a_release(tmp_path: Path) -> None:
    write_config(tmp_path, f"dft-{uuid.uuid4().hex[:10]}")
    result = dflash(tmp_path, "plan")
    assert result.returncode == 1
    assert "Nothing is deployed" in result.stderr and "Deploy first" in result.stderr
