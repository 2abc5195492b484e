"""`dflash stop` with the real trainer in local tmux: the job saves the step it was in and exits 0,
`dflash restart` resumes there; `dflash stop --no-save` ends it at once. `deploy --resume
--force-resume` hands the trainer its flag for that start only; hints carry `--config`."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from tests.cli_helpers import REPO, Where, dflash
from tests.system.test_rollback import local  # noqa: F401 (a fixture)
from tests.trainer.test_train import assets, write_toml  # noqa: F401 (a fixture)


def trainer_job(where: Where, config: Path, steps: int, *, stop_timeout: float = 30) -> None:
    """A `[job] command` running this checkout's trainer into the target's checkpoints."""
    command = (
        f"{sys.executable} -m trainer train --config {config} "
        f'--out "$DFLASH_CHECKPOINTS" --set run.steps={steps}'
    )
    where.config(command, env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    toml = where.project / "deploy.toml"
    toml.write_text(toml.read_text().replace("stop_timeout = 3", f"stop_timeout = {stop_timeout}"))


def wait_rows(where: Where, n: int, timeout: float = 90) -> None:
    metrics, end = where.checkpoints / "metrics.jsonl", time.monotonic() + timeout
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= n):
        assert time.monotonic() < end, (where.checkpoints / "train_stdout.log").read_text()
        time.sleep(0.1)


def test_stop_saves_the_step_and_restart_resumes_it(local: Where, tmp_path, assets) -> None:  # noqa: F811
    trainer_job(local, write_toml(tmp_path / "c.toml", assets), 100000)
    assert local.run("deploy").returncode == 0
    wait_rows(local, 3)
    stopped = local.run("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert "(exit 0)" in stopped.stderr, stopped.stderr
    log = (local.checkpoints / "train_stdout.log").read_text()
    line = next(x for x in log.splitlines() if x.startswith("stopped at step"))
    n = int(line.split()[3].rstrip(","))
    assert f"checkpoint saved to {local.checkpoints}/step-{n:08d}" in line
    rows = (local.checkpoints / "metrics.jsonl").read_text().splitlines()
    assert json.loads(rows[-1])["step"] == n  # no completed step is lost
    assert local.run("restart").returncode == 0
    end = time.monotonic() + 90
    while f"resumed from step-{n:08d} (step {n})" not in (
        text := (local.checkpoints / "train_stdout.log").read_text()
    ):
        assert time.monotonic() < end, text[-2000:]
        time.sleep(0.2)


def test_stop_no_save_ends_the_job_without_a_checkpoint(local: Where, tmp_path, assets) -> None:  # noqa: F811
    trainer_job(local, write_toml(tmp_path / "c.toml", assets), 100000)
    assert local.run("deploy").returncode == 0
    wait_rows(local, 2)
    stopped = local.run("stop", "--no-save")
    assert stopped.returncode == 0, stopped.stderr
    assert "(exit 130)" in stopped.stderr, stopped.stderr
    log = (local.checkpoints / "train_stdout.log").read_text()
    assert "stopped at step" not in log and "interrupted" in log
    assert not list(local.checkpoints.glob("step-*")) and not list(local.checkpoints.glob(".tmp-*"))


def test_force_resume_reaches_this_start_only(local: Where) -> None:  # noqa: F811
    local.config('echo "force=${DFLASH_FORCE_RESUME:-}"; sleep 30')
    usage = local.run("deploy", "--force-resume")
    assert usage.returncode == 2 and "--force-resume needs --resume" in usage.stderr
    assert local.run("deploy", "--resume", "--force-resume").returncode == 0
    log = local.checkpoints / "train_stdout.log"
    end = time.monotonic() + 20
    while "force=" not in (log.read_text() if log.exists() else ""):
        assert time.monotonic() < end
        time.sleep(0.1)
    assert "force=1" in log.read_text()
    assert local.run("restart").returncode == 0
    end = time.monotonic() + 20
    while log.read_text().count("force=") < 2:
        assert time.monotonic() < end
        time.sleep(0.1)
    assert log.read_text().splitlines()[-1] == "force="


def test_hints_carry_the_config_file(local: Where) -> None:  # noqa: F811
    local.config("echo up; exec sleep 30")
    other = local.project / "other.toml"
    (local.project / "deploy.toml").rename(other)
    done = dflash(local.project, "--config", str(other), "deploy")
    assert done.returncode == 0, done.stderr
    assert f"Follow it with: dflash --config {other} logs --follow" in done.stderr
