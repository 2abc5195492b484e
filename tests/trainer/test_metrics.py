"""`metrics.jsonl` survives a full disk: rows are appended whole or not at all, a torn line (a
write cut short) is cut on resume and never parsed; end to end on a small tmpfs filled in the
middle of a run and then freed, the next start resumes. After kills (real SIGKILL, with and
without a checkpoint to resume) the rows and the curves read as one series."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.cli_helpers import train_argv
from tests.trainer.test_probe import scalars
from tests.trainer.test_train import assets, tiny_config, write_toml  # noqa: F401 (a fixture)
from trainer.model.checkpoint import find_resumable
from trainer.run.curves import available
from trainer.run.metrics import ASIDE, truncate_rows
from trainer.run.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]


def test_a_hand_torn_last_line_is_cut_not_parsed(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 6)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "lo')
    trimmed = truncate_rows(path, 4)
    assert (trimmed.kept, trimmed.dropped) == (4, 1)
    assert trimmed.torn == ["line 6: JSONDecodeError"]
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:4]


def test_lines_that_are_not_rows_are_cut_wherever_they_are(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\xff\xfe\n[1, 2]\n{"loss": 3}\n{"step": 2}\n')
    trimmed = truncate_rows(path, 10)
    assert trimmed.kept == 2 and len(trimmed.torn) == 3
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_resume_after_a_torn_line_says_so_and_continues(tmp_path, assets) -> None:  # noqa: F811
    cfg = tiny_config(assets, run={"steps": 6, "checkpoint_every": 3})
    out = tmp_path / "run"
    Trainer(cfg, out, emit=lambda _: None).run(until=4)
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 5, "loss": 0.12')  # the write the disk cut short
    lines: list[str] = []
    Trainer(cfg, out, emit=lines.append).run()
    assert any("cut an unreadable line 5" in line for line in lines), lines
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]


# In a private mount namespace: a small tmpfs holds the run folder. The run is started, the disk
# is filled once the checkpoint of step 20 is there (the rows after it fill what is left of the
# file's last page, then one append finds no space, before the next checkpoint), then freed, and
# the run is started again.
_FILL_AND_FREE = r"""
set -u
mount -t tmpfs -o size=6m tmpfs "$1" 2>"$4/mount.err" || exit 77
"$2" -m trainer train --config "$3" --out "$1/run" --set run.steps=100000 \
  --set run.checkpoint_every=20 > "$4/first.out" 2> "$4/first.err" &
pid=$!
n=0
until [ -d "$1/run/step-00000020" ]; do
  n=$((n + 1)); [ "$n" -lt 900 ] || { kill "$pid"; exit 9; }; sleep 0.1
done
dd if=/dev/zero of="$1/filler" bs=4k 2>/dev/null
wait "$pid"; echo "$?" > "$4/first.code"
cp "$1/run/metrics.jsonl" "$4/metrics.full"
rm -f "$1/filler"
step=$("$2" -c "
import sys; from trainer.model.checkpoint import find_resumable
print(find_resumable(sys.argv[1]).manifest.step)" "$1/run")
"$2" -m trainer train --config "$3" --out "$1/run" --set run.steps=$((step + 2)) \
  --set run.extend=true --set run.checkpoint_every=1 > "$4/second.out" 2> "$4/second.err"
echo "$?" > "$4/second.code"
echo "$step" > "$4/step"
cp "$1/run/metrics.jsonl" "$4/metrics.final"
"""


def test_disk_filled_mid_run_then_freed_resumes(tmp_path, assets) -> None:  # noqa: F811
    config = write_toml(tmp_path / "c.toml", assets)
    Trainer(tiny_config(assets, run={"steps": 1}), tmp_path / "warm", emit=lambda _: None)
    (tmp_path / "mnt").mkdir()
    report = tmp_path / "report"
    report.mkdir()
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", _FILL_AND_FREE, "fill",
         str(tmp_path / "mnt"), sys.executable, str(config), str(report)],
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    if done.returncode == 77 or (done.returncode != 0 and "unshare" in done.stderr):
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    first_err = (report / "first.err").read_text()
    assert (report / "first.code").read_text().strip() == "1", first_err
    assert "No space left on device (" in first_err and "Traceback" not in first_err
    # whichever write met the full disk first says so: most often the metrics row appended every
    # step, sometimes the checkpoint being written at that moment
    row_append = "metrics.jsonl)\nhint: free space" in first_err
    checkpoint = "Free space or fix permissions in the run folder" in first_err
    assert row_append or checkpoint, first_err
    full = (report / "metrics.full").read_bytes()
    assert full.endswith(b"\n")  # the row being written when the disk filled is not half there
    assert [json.loads(line)["step"] for line in full.splitlines()][:21] == list(range(1, 22))
    assert (report / "second.code").read_text().strip() == "0", (report / "second.err").read_text()
    step = int((report / "step").read_text())
    assert step == 20 and f"resumed from step-{step:08d}" in (report / "second.out").read_text()
    final = [json.loads(x)["step"] for x in (report / "metrics.final").read_text().splitlines()]
    assert final == list(range(1, step + 3))


# ---- kill-then-restart chains: one series --------------------------------------------------


def steps_of(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def trainer_argv(config: Path, out: Path, *sets: str) -> list[str]:
    return train_argv(config, out, *(arg for item in sets for arg in ("--set", item)))


def kill_when(argv: list[str], ready: Callable[[], bool], what: str) -> None:
    """Start the trainer, SIGKILL it once `ready()` holds."""
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        end = time.monotonic() + 180
        while not ready():
            assert proc.poll() is None, f"ended before {what}: {proc.stderr.read()!r}"  # type: ignore[union-attr]
            assert time.monotonic() < end, f"never saw {what}"
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        assert proc.stderr is not None
        proc.stderr.close()


def rows_at_least(out: Path, n: int) -> Callable[[], bool]:
    def ready() -> bool:
        path = out / "metrics.jsonl"
        return path.is_file() and path.read_bytes().count(b"\n") >= n

    return ready


def past_a_checkpoint(out: Path) -> Callable[[], bool]:
    """A verified checkpoint exists and rows were written after it (they must be cut)."""

    def ready() -> bool:
        found = find_resumable(out)
        if found.manifest is None or not (out / "metrics.jsonl").is_file():
            return False
        return steps_of(out / "metrics.jsonl")[-1] > found.manifest.step

    return ready


def test_kill_restart_chains_leave_one_series(tmp_path: Path, assets) -> None:  # noqa: F811
    """SIGKILL before the first checkpoint, a start from scratch killed after its checkpoint,
    then a resume to the end: the rows (and the curves) are 1, 2, …, N once each; the first
    start's rows are kept aside."""
    config = write_toml(tmp_path / "c.toml", assets)
    Trainer(tiny_config(assets, run={"steps": 1}), tmp_path / "warm", emit=lambda _: None)
    out = tmp_path / "run"
    long = ("run.steps=400", "run.log_every=1")
    kill_when(trainer_argv(config, out, *long, "run.checkpoint_every=0"),
              rows_at_least(out, 3), "three rows")  # fmt: skip
    killed = steps_of(out / "metrics.jsonl")
    assert killed[:3] == [1, 2, 3] and find_resumable(out).path is None
    kill_when(trainer_argv(config, out, *long, "run.checkpoint_every=3"),
              past_a_checkpoint(out), "rows past a checkpoint")  # fmt: skip
    resumed = find_resumable(out).manifest
    assert resumed is not None
    done = subprocess.run(
        trainer_argv(config, out, f"run.steps={resumed.step + 3}", "run.extend=true"),
        env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"resumed from step-{resumed.step:08d}" in done.stdout
    steps = steps_of(out / "metrics.jsonl")
    assert steps == list(range(1, resumed.step + 4))
    (aside,) = (out / ASIDE).iterdir()  # the first start's rows, as it left them
    assert steps_of(aside / "metrics.jsonl") == killed
    if available():
        assert [s for s, _ in scalars(out / "tensorboard")["loss/total"]] == steps


def test_a_torn_row_left_by_a_kill_costs_the_next_start_no_row(tmp_path, assets) -> None:  # noqa: F811
    """A start killed before its first checkpoint in the middle of a row's write (the row
    torn: no newline): the next start begins its own file, so its first row is not glued to
    the torn one (and cut with it when a later start resumes)."""
    cfg = tiny_config(assets, run={"steps": 6, "checkpoint_every": 0})
    out = tmp_path / "run"
    Trainer(cfg, out, emit=lambda _: None).run(until=3)  # no checkpoint yet
    with open(out / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 4, "loss": 0.1')  # the rest of the row never came
    cfg = tiny_config(assets, run={"steps": 6, "checkpoint_every": 2})
    lines: list[str] = []
    Trainer(cfg, out, emit=lines.append).run(until=4)
    Trainer(cfg, out, emit=lambda _: None).run()  # resumed from step 4
    assert steps_of(out / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    assert any(f"moved to {out / ASIDE}" in line for line in lines), lines
    (aside,) = (out / ASIDE).iterdir()
    assert (aside / "metrics.jsonl").read_text().endswith('{"step": 4, "loss": 0.1')


@pytest.mark.slow  # ~40 s on a loaded 2-core machine: up to four starts of the trainer
@pytest.mark.parametrize("seed", range(3))
def test_kill_chains_at_random_moments_leave_one_series(tmp_path, assets, seed: int) -> None:  # noqa: F811
    """One to three interruptions at random moments (SIGKILL, or SIGINT/SIGTERM, sometimes
    followed by SIGKILL), each a few rows into a start, then a start that runs to the end."""
    rng = random.Random(seed)
    config = write_toml(tmp_path / "c.toml", assets)
    Trainer(tiny_config(assets, run={"steps": 1}), tmp_path / "warm", emit=lambda _: None)
    out, steps = tmp_path / "run", 12
    sets = (
        f"run.steps={steps}",
        "run.log_every=1",
        f"run.checkpoint_every={rng.choice([2, 3, 5])}",
    )
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    for _ in range(rng.randint(1, 3)):
        rows = len(steps_of(out / "metrics.jsonl")) if (out / "metrics.jsonl").is_file() else 0
        proc = subprocess.Popen(trainer_argv(config, out, *sets), env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        ready = rows_at_least(out, rows + rng.randint(1, 3))
        end = time.monotonic() + 180
        while not ready() and proc.poll() is None and time.monotonic() < end:
            time.sleep(0.002)
        time.sleep(rng.random() * 0.2)
        proc.send_signal(
            rng.choice([signal.SIGKILL, signal.SIGKILL, signal.SIGINT, signal.SIGTERM])
        )
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.3)
            proc.kill()
        proc.wait()
    done = subprocess.run(trainer_argv(config, out, *sets), env=env, capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert steps_of(out / "metrics.jsonl") == list(range(1, steps + 1))
    if available():
        assert [s for s, _ in scalars(out / "tensorboard")["loss/total"]] == list(
            range(1, steps + 1)
        )
