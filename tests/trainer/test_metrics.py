"""`metrics.jsonl` survives a full disk: rows are appended whole or not at all, a torn line (a
write cut short) is cut on resume and never parsed; end to end on a small tmpfs filled in the
middle of a run and then freed, the next start resumes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.test_train import assets, tiny_config, write_toml  # noqa: F401 (a fixture)
from trainer.metrics import truncate_rows
from trainer.trainer import Trainer

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
"$2" -m trainer.train --config "$3" --out "$1/run" --set run.steps=100000 \
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
import sys; from trainer.checkpoint import find_resumable
print(find_resumable(sys.argv[1]).manifest.step)" "$1/run")
"$2" -m trainer.train --config "$3" --out "$1/run" --set run.steps=$((step + 2)) \
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
