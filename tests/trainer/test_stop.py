"""A graceful stop loses no completed step: SIGINT during a step and during a checkpoint write,
colocated (`python -m trainer train`) and split (torchrun through `trainer.commands.launcher`, gloo on
the CPU). The stopped run exits 0 naming the step and its checkpoint; starting again resumes
there and the losses continue exactly as in an uninterrupted run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.cli_helpers import train_argv
from tests.signal_helpers import handlers_installed
from tests.trainer.test_split import (
    ROOT,
    finish,
    free_port,
    processes_with,
    write_config,
)
from tests.trainer.test_split import assets as split_assets  # noqa: F401 (a fixture)
from tests.trainer.test_train import assets, tiny_config, write_toml  # noqa: F401 (a fixture)
from trainer.model.checkpoint import find_resumable
from trainer.run.trainer import Trainer
from trainer.settings.loading import load_config

ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def train(config: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        train_argv(config, out, *extra),
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def wait_for_rows(proc: subprocess.Popen[str], out: Path, n: int, timeout: float = 90) -> None:
    metrics, end = out / "metrics.jsonl", time.monotonic() + timeout
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= n):
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < end, "the run did not get going"
        time.sleep(0.05)


def interrupt(proc: subprocess.Popen[str], out: Path, *, after_rows: int, steps: int) -> int:
    """SIGINT once `after_rows` rows are logged: the run saves, exits 0 and names the step N,
    and the newest verified checkpoint is step N."""
    wait_for_rows(proc, out, after_rows)
    proc.send_signal(signal.SIGINT)
    log = finish(proc, 90)
    assert proc.returncode == 0, log[-4000:]
    n = stopped_step(log)
    assert after_rows <= n < steps, log[-3000:]
    found = find_resumable(out)
    assert found.manifest is not None and found.manifest.step == n
    return n


def stopped_step(log: str) -> int:
    line = next(x for x in log.splitlines() if x.startswith("stopped at step"))
    assert "checkpoint saved to" in line, line
    return int(line.split()[3].rstrip(","))


def uninterrupted(assets: Path, tmp_path: Path, steps: int) -> list[float]:  # noqa: F811
    cfg = tiny_config(assets, run={"steps": steps, "checkpoint_every": 0})
    return [r.loss for r in Trainer(cfg, tmp_path / "full", emit=lambda _: None).run()]


def test_sigint_during_a_step_saves_it_and_resume_continues_exactly(tmp_path, assets) -> None:  # noqa: F811
    steps = 30
    cfg = write_toml(tmp_path / "c.toml", assets)
    out = tmp_path / "run"
    proc = train(cfg, out, "--set", f"run.steps={steps}")
    n = interrupt(proc, out, after_rows=3, steps=steps)
    assert [r["step"] for r in rows(out)][-1] == n  # every completed step is logged and saved
    resumed = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--config", str(cfg), "--out", str(out),
         "--set", f"run.steps={steps}"],
        env=ENV, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from step-{n:08d} (step {n})" in resumed.stdout
    assert [r["loss"] for r in rows(out)] == uninterrupted(assets, tmp_path, steps)


def test_sigint_during_a_checkpoint_write_keeps_that_checkpoint(tmp_path, assets) -> None:  # noqa: F811
    """The signal lands while `.tmp-step-N` is being written: that write completes, the run stops
    at step N, nothing is left half-written."""
    steps = 60
    cfg = write_toml(tmp_path / "c.toml", assets)
    for trial in range(3):  # bounded: the write takes milliseconds
        out = tmp_path / f"run-{trial}"
        proc = train(cfg, out, "--set", f"run.steps={steps}", "--set", "run.checkpoint_every=1")
        caught, end = None, time.monotonic() + 90
        while caught is None and time.monotonic() < end and proc.poll() is None:
            if out.is_dir():
                temps = [p.name for p in out.iterdir() if p.name.startswith(".tmp-step-")]
                if temps and len(rows(out) if (out / "metrics.jsonl").exists() else []) >= 2:
                    proc.send_signal(signal.SIGINT)
                    caught = int(temps[0].split("-")[2])
            time.sleep(0.0005)
        log = finish(proc, 60)
        if caught is not None:
            break
    assert caught is not None, "no checkpoint write was caught in progress"
    assert proc.returncode == 0, log[-3000:]
    n = stopped_step(log)
    assert n in (caught, caught + 1), (caught, log[-2000:])
    assert not list(out.glob(".tmp-step-*"))
    found = find_resumable(out)
    assert found.manifest is not None and found.manifest.step == n
    resumed = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--config", str(cfg), "--out", str(out),
         "--set", f"run.steps={steps}", "--set", "run.checkpoint_every=1"],
        env=ENV, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert [r["loss"] for r in rows(out)] == uninterrupted(assets, tmp_path, steps)


def test_second_signal_ends_at_once_leaving_only_complete_checkpoints(tmp_path, assets) -> None:  # noqa: F811
    cfg = write_toml(tmp_path / "c.toml", assets)
    out = tmp_path / "run"
    proc = train(cfg, out, "--set", "run.steps=100000", "--set", "run.checkpoint_every=1")
    wait_for_rows(proc, out, 2)
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)  # two of one kind may reach the process as one
    log = finish(proc, 60)
    assert proc.returncode == 130, log[-3000:]
    assert "interrupted" in log and "Traceback" not in log
    assert "stopped at step" not in log
    found = find_resumable(out)
    assert found.path is not None and not found.skipped


def test_finished_run_says_there_is_nothing_left(tmp_path, assets) -> None:  # noqa: F811
    cfg = write_toml(tmp_path / "c.toml", assets)
    out = tmp_path / "run"
    Trainer(tiny_config(assets, run={"steps": 2}), out, emit=lambda _: None).run()
    done = subprocess.run(
        [sys.executable, "-m", "trainer", "train", "--config", str(cfg), "--out", str(out),
         "--set", "run.steps=2"],
        env=ENV, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "nothing left to do: step-00000002 is at step 2 and run.steps = 2" in done.stdout


# ---- split -----------------------------------------------------------------------------------


def launcher(config: Path, out: Path, *, procs: int, targets: int) -> subprocess.Popen[str]:
    env = {**ENV, "DFLASH_TARGET_GPUS": str(targets)}
    argv = [
        sys.executable, "-m", "trainer", "launch", "--nproc-per-node", str(procs),
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        "-m", "trainer", "train", "--config", str(config), "--out", str(out),
    ]  # fmt: skip
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )


def split_stop_and_resume(
    tmp_path: Path,
    folder: Path,
    *,
    procs: int,
    targets: int,
    steps: int,  # noqa: F811
    device: str = "cpu",
) -> tuple[Path, int, list[dict]]:
    out = tmp_path / f"split-{uuid.uuid4().hex[:8]}"
    cfg = write_config(tmp_path / "c.toml", folder, steps=steps, checkpoint_every=0, device=device)
    proc = launcher(cfg, out, procs=procs, targets=targets)
    n = interrupt(proc, out, after_rows=2, steps=steps)
    first = [json.loads((out / "ranks" / f"rank-{r}.json").read_text()) for r in range(procs)]
    proc = launcher(cfg, out, procs=procs, targets=targets)
    log2 = finish(proc, 90)
    assert proc.returncode == 0, log2[-4000:]
    assert f"resumed from step-{n:08d}" in log2
    assert processes_with(out.name) == [], "a worker outlived the job"
    second = [json.loads((out / "ranks" / f"rank-{r}.json").read_text()) for r in range(procs)]
    return out, n, first + second


@pytest.mark.slow
def test_split_stop_repeats_the_colocated_losses(tmp_path, split_assets) -> None:  # noqa: F811
    # enough steps that the stop, sent after 2 rows, lands mid-run even when a loaded machine
    # delivers the signal a second late (10 steps could all finish first)
    steps = 30
    out, n, ranks = split_stop_and_resume(tmp_path, split_assets, procs=2, targets=1, steps=steps)
    trained = [i for r in ranks if r["role"] == "drafter" for i in r["indices"]]
    assert trained == list(range(steps))  # each batch once, in order, across the stop
    cfg = load_config(write_config(tmp_path / "c3.toml", split_assets, steps=steps,
                                   checkpoint_every=0))  # fmt: skip
    colocated = [r.loss for r in Trainer(cfg, tmp_path / "colo", emit=lambda _: None).run()]
    assert [r["loss"] for r in rows(out)] == pytest.approx(colocated, rel=1e-6, abs=0)


@pytest.mark.slow
def test_split_stop_two_drafters_agree_on_the_step(tmp_path, split_assets) -> None:  # noqa: F811
    steps = 24  # as above: the stop lands mid-run
    out, n, ranks = split_stop_and_resume(tmp_path, split_assets, procs=3, targets=1, steps=steps)
    trained = sorted(i for r in ranks if r["role"] == "drafter" for i in r["indices"])
    assert trained == list(range(steps * 2))  # nothing lost or trained twice across the stop
    assert ranks[1]["batches"] == ranks[2]["batches"] == n  # both drafters stopped at step n
    assert ranks[4]["params_sha256"] == ranks[5]["params_sha256"]
    assert [r["step"] for r in rows(out)] == list(range(1, steps + 1))


def test_a_stop_before_the_first_step_ends_at_once(tmp_path, assets) -> None:  # noqa: F811
    """Nothing is trained yet (torch and the target still load): nothing to save, no waiting.
    The signal lands at moments spread over the start-up's first half (imports), one run each:
    every one ends at once with 130, no traceback and nothing written. (Raised as
    `KeyboardInterrupt` into the imports, a stop was sometimes lost inside torch's import of
    numpy and the run trained on, or left numpy half-imported and crashed.)"""
    from trainer.setup.demo import ensure_demo_assets

    cfg = write_toml(tmp_path / "c.toml", assets)
    ensure_demo_assets(assets, load_config(cfg, []).demo)  # built now, not inside a timed run
    calibrate = train(cfg, tmp_path / "calibrate", "--set", "run.steps=100000")
    installed = handlers_installed(calibrate)
    wait_for_rows(calibrate, tmp_path / "calibrate", 1)
    first_row = time.monotonic() - installed  # training began before this
    calibrate.send_signal(signal.SIGINT)
    finish(calibrate, 60)
    for i in range(12):  # most of them while torch imports (the first half of the start-up)
        moment = i * 0.45 * first_row / 11  # from the handler's installation on
        out = tmp_path / f"run-{i}"
        proc = train(cfg, out, "--set", "run.steps=100000")
        time.sleep(max(0.0, handlers_installed(proc) + moment - time.monotonic()))
        assert proc.poll() is None and not (out / "metrics.jsonl").exists()
        proc.send_signal(signal.SIGINT)
        log = finish(proc, 15)
        where = f"SIGINT {moment:.2f} s after the handler's installation:\n{log[-3000:]}"
        assert proc.returncode == 130, where
        assert "interrupted" in log and "Traceback" not in log, where
        assert not (out / "metrics.jsonl").exists() and find_resumable(out).path is None, where


SWALLOWING_IMPORT = """
import os, signal, sys
from trainer.base.stopping import StopRequest

with StopRequest().handling():
    try:  # what torch's C module does with its import of numpy: any error of it is cleared
        os.kill(os.getpid(), signal.SIGINT)
        sum(range(10_000))  # the handler runs between these bytecodes
    except BaseException:
        pass
    print("went on after the stop", flush=True)
"""


def test_a_stop_before_the_first_step_is_not_lost_in_a_library_that_catches_everything() -> None:
    """Before training begins the first signal ends the process there and then: a library
    that catches every exception around the moment it lands cannot swallow it."""
    proc = subprocess.run(
        [sys.executable, "-c", SWALLOWING_IMPORT],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 130, proc.stdout + proc.stderr
    assert "went on" not in proc.stdout
    assert "SIGINT received before the first step: nothing to save" in proc.stderr


def test_a_run_in_process_gives_the_callers_signal_handlers_back(tmp_path, assets) -> None:  # noqa: F811
    """`trainer.commands.train.main` called in a process of its own caller (a notebook, a test) handles
    SIGINT/SIGTERM only while it runs: after it, Ctrl-C is the caller's again."""
    from trainer.commands.train import main

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    cfg = write_toml(tmp_path / "c.toml", assets)
    assert main(["--config", str(cfg), "--out", str(tmp_path / "run"), "--set", "run.steps=2"]) == 0
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
