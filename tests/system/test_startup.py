"""Deploy and restart wait until the job is past start-up: a job that dies there fails the
command with its log's last lines (on this machine and in a container of the `pct` stand-in);
the real trainer is waited for until its readiness line; `--no-wait` and `start_wait = 0` do
not wait."""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dflash_ops.commands.operations import STARTED
from tests.cli_helpers import REPO, Where, dflash, kill_tmux_server, remote_where
from tests.system.test_cli_export import train_tables
from tests.trainer.test_train import assets  # noqa: F401 (a fixture)
from trainer.base.stopping import started_line

# Thirty lines, then a failure: only the last twenty lines come back, the error among them.
DIES = (
    "for i in $(seq 1 30); do echo loading part $i; done; "
    'echo "error: cannot open /data/train.jsonl" >&2; exit 3'
)


@pytest.fixture(params=["local", "proxmox"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Where]:
    if request.param == "local":
        project = tmp_path / "project"
        project.mkdir()
        root = project / ".dflash" / "local"
        spot = Where(
            "local", project, [], root, root / "checkpoints", f"dft-{uuid.uuid4().hex[:10]}"
        )
        yield spot
        kill_tmux_server(spot.socket)
    else:
        yield from remote_where(request, tmp_path, 260)


def test_a_job_that_dies_at_start_up_fails_the_deploy_with_its_last_lines(where: Where) -> None:
    where.config(DIES, extra='ready = "serving"\n')  # a readiness line it never reaches
    deployed = where.run("deploy", *where.flags)
    assert deployed.returncode == 1, deployed.stderr
    err = deployed.stderr
    assert "ended at start-up" in err and "(exit 3)" in err and "Traceback" not in err
    assert "error: cannot open /data/train.jsonl" in err and "loading part 30" in err
    assert "loading part 10\n" not in err  # the tail is bounded
    assert "hint: Fix what it says, then run dflash deploy again" in err
    assert "✓ Deployed" not in err

    skipped = where.run("deploy", "--no-wait")  # the old behaviour, on request
    assert skipped.returncode == 0, skipped.stderr
    assert "Deployed" in skipped.stderr and "start-up" not in skipped.stderr


def test_restart_waits_for_the_new_start_not_the_old_lines(where: Where) -> None:
    """The first start logs a line and runs; the restart's start dies silently: the old line in
    the (kept) log must not pass for the new job's."""
    where.config(
        'if [ -e "$DFLASH_CHECKPOINTS/started-once" ]; then exit 4; fi; '
        'touch "$DFLASH_CHECKPOINTS/started-once"; echo up; exec sleep 60'
    )
    first = where.run("deploy", *where.flags)
    assert first.returncode == 0, first.stderr
    assert "running, past start-up" in first.stderr
    again = where.run("restart")
    assert again.returncode == 1, again.stderr
    assert "ended at start-up" in again.stderr and "(exit 4)" in again.stderr
    assert "run dflash restart again" in again.stderr


def test_a_silent_job_is_still_starting_after_the_wait(where: Where) -> None:
    where.config("exec sleep 60", extra="start_wait = 1\n")
    deployed = where.run("deploy", *where.flags)
    assert deployed.returncode == 0, deployed.stderr
    assert "running, still starting after 1 s" in deployed.stderr
    assert where.status()["running"]
    where.run("stop")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_the_trainer_is_waited_for_until_it_trains(tmp_path: Path, assets: Path) -> None:  # noqa: F811
    """The default launch runs the trainer. A config for a GPU deployed to a CPU-only place
    dies in start-up, after the check passed: the deploy fails with the traceback's end. Fixed,
    the deploy returns once the trainer logged its readiness line."""
    project = tmp_path / "project"
    shutil.copytree(
        REPO / "trainer", project / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    tables = train_tables(str(assets)).replace("steps = 2\n", "steps = 100000\n")
    head = (
        f"[target]\npython = {json.dumps(sys.executable)}\n\n[job]\nsocket = {json.dumps(socket)}\n"
        'env = { OMP_NUM_THREADS = "1" }\nstop_timeout = 10\nstart_wait = 300\n\n'
    )
    toml = project / "deploy.toml"
    toml.write_text(head + tables.replace('device = "cpu"', 'device = "cuda"'))
    try:
        failed = dflash(project, "deploy", timeout=400)
        assert failed.returncode == 1, failed.stderr
        assert "ended at start-up" in failed.stderr and "(exit 1)" in failed.stderr
        assert "Torch not compiled with CUDA enabled" in failed.stderr

        toml.write_text(head + tables)
        deployed = dflash(project, "deploy", timeout=400)
        assert deployed.returncode == 0, deployed.stderr
        assert "running, past start-up" in deployed.stderr
        log = (project / ".dflash" / "local" / "checkpoints" / "train_stdout.log").read_text()
        assert f"{started_line(0, 100000)}\n" in log and started_line(0, 1).startswith(STARTED)
    finally:
        dflash(project, "stop", "--no-save")
        kill_tmux_server(socket)
