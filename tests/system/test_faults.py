"""Faults, with real parts: the connection dropped in the middle of a deploy's upload (real
sshd), the trainer SIGKILLed while writing a checkpoint and a full disk under the checkpoints
(real torch, a private tmpfs)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_helpers import REPO, Where, container_defaults, kill_tmux_server, train_argv
from tests.trainer.test_train import write_toml
from trainer.model.checkpoint import find_resumable, verify


@pytest.fixture
def ssh_where(tmp_path: Path, ssh_home: object) -> Iterator[Where]:
    project = tmp_path / "project"
    (project / "trainer").mkdir(parents=True)
    root, ckpt = tmp_path / "root", tmp_path / "ckpt"
    spot = Where("ssh", project, ["--target", "box"], root, ckpt, f"dft-{uuid.uuid4().hex[:10]}")
    spot.targets = (
        f'[targets.box]\nplace = "ssh"\nhost = "testbox"\nroot = "{root}"\ncheckpoints = "{ckpt}"\n'
    )
    yield spot
    kill_tmux_server(spot.socket)


def uploading(since: float) -> bool:
    """Whether a deploy's program (on this machine: the sshd is on loopback) is receiving its
    bundle now: its watcher writes it to `<TMPDIR>/dflash-deploy.*/bundle.part` as it comes."""
    for part in Path(tempfile.gettempdir()).glob("dflash-deploy.*/bundle.part"):
        try:
            if part.stat().st_mtime >= since and part.stat().st_size > 0:
                return True
        except OSError:
            continue
    return False


def test_connection_dropped_during_upload(ssh_where: Where, sshd) -> None:  # type: ignore[no-untyped-def]
    where = ssh_where
    where.config('echo "run of $DFLASH_RELEASE"; sleep 120')
    assert where.run("deploy", *where.flags).returncode == 0
    (first,) = where.releases()
    before = where.status()
    assert before["running"]
    # A bundle big enough to be caught in flight (random data does not compress).
    (where.project / "trainer" / "blob.bin").write_bytes(os.urandom(96 * 1024 * 1024))
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_ops", "deploy"],
        cwd=where.project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    releases = where.root / "releases"
    began, end = time.time(), time.monotonic() + 60
    while not uploading(began) and time.monotonic() < end:
        time.sleep(0.005)
    assert uploading(began), "the upload was never seen in flight"
    sshd.stop()  # drops every connection, the upload's included
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        sshd.start()
    assert proc.returncode == 1 and "Traceback" not in err, err
    # The deploy's one command took the lock at the place; its EXIT trap removes it unless the
    # command was killed first, and then the lock is left behind, stale.
    left_locked = (where.root / "deploy.lock").is_symlink()
    assert os.readlink(where.root / "current") == f"releases/{first}"
    assert [p.name for p in releases.iterdir() if (p / ".complete").exists()] == [first]
    report = where.status()
    assert report["running"] and report["release"] == first  # the job was never touched
    assert report["started_at"] == before["started_at"]

    (where.project / "trainer" / "blob.bin").unlink()
    again = where.run("deploy", "--resume")  # a lock the dead deploy left is taken over
    assert again.returncode == 0, again.stderr
    if left_locked:  # its script at the place is gone
        assert "Taking over the deploy lock" in again.stderr and "has ended" in again.stderr
    assert not (where.root / "deploy.lock").is_symlink()
    assert not list(releases.glob("*.tmp"))  # the unfinished release is gone
    assert where.status()["release"] == where.releases()[-1] != first
    where.run("stop")


TINY_RUN = ["--set", "run.steps=400", "--set", "run.checkpoint_every=1"]


def test_sigkill_while_writing_a_checkpoint_resumes_from_the_previous(tmp_path: Path) -> None:
    config = write_toml(tmp_path / "c.toml", tmp_path / "assets")
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        train_argv(config, out, *TINY_RUN), env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    caught = None
    end = time.monotonic() + 90
    while caught is None and time.monotonic() < end and proc.poll() is None:
        if out.is_dir():
            complete = [p for p in out.iterdir() if p.name.startswith("step-")]
            temps = [p for p in out.iterdir() if p.name.startswith(".tmp-step-")]
            if temps and len(complete) >= 2:
                os.kill(proc.pid, signal.SIGKILL)
                caught = temps[0].name
        time.sleep(0.0005)
    if caught is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert caught is not None, "no checkpoint write was caught in progress"
    found = find_resumable(out)
    assert found.path is not None and verify(found.path)[0] is not None
    torn = int(caught.split("-")[2])
    assert found.manifest is not None and found.manifest.step >= torn - 1
    resumed = subprocess.run(
        train_argv(config, out, "--set", f"run.steps={found.manifest.step + 2}", "--set", "run.extend=true",
                    "--set", "run.checkpoint_every=1"),
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {found.path.name}" in resumed.stdout + resumed.stderr
    assert not list(out.glob(".tmp-step-*"))


# Inside a private mount namespace: a 3 MiB tmpfs over the run folder's parent; one checkpoint
# is written, the disk is then filled, and the next run's checkpoint cannot be written.
_FULL_DISK = r"""
set -u
mount -t tmpfs -o size=3m tmpfs "$1"
"$2" -m trainer train --config "$3" --out "$1/run" --set run.steps=1 --set run.checkpoint_every=1 \
  >/dev/null 2>&1 || { echo "first run failed" >&2; exit 9; }
dd if=/dev/zero of="$1/filler" bs=64k 2>/dev/null
"$2" -m trainer train --config "$3" --out "$1/run" --set run.steps=3 --set run.checkpoint_every=1 --set run.extend=true \
  > "$4/second.out" 2> "$4/second.err"
echo "exit=$?" > "$4/second.code"
"$2" -c "
import json, sys
from trainer.model.checkpoint import find_resumable, verify
found = find_resumable(sys.argv[1])
print(json.dumps({'path': str(found.path), 'ok': verify(found.path)[0] is not None,
                  'step': found.manifest.step}))
" "$1/run" > "$4/after.json"
ls -a "$1/run" > "$4/ls.txt"
"""


def test_full_disk_at_the_checkpoint_folder(tmp_path: Path) -> None:
    config = write_toml(tmp_path / "c.toml", tmp_path / "assets")
    (tmp_path / "mnt").mkdir()
    report = tmp_path / "report"
    report.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "bash", "-c", _FULL_DISK, "full-disk",
         str(tmp_path / "mnt"), sys.executable, str(config), str(report)],
        env=env, capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    code = (report / "second.code").read_text().strip()
    err = (report / "second.err").read_text()
    assert code == "exit=1" and "Traceback" not in err, (code, err)  # docs/reliability.md
    assert "No space left on device" in err and "newest complete checkpoint" in err
    after = json.loads((report / "after.json").read_text())
    assert after["ok"] and after["step"] == 1  # the previous checkpoint, intact and verified
    assert not [n for n in (report / "ls.txt").read_text().split() if n.startswith(".tmp-step")]


def test_container_stopped_in_the_middle_of_a_stop(tmp_path: Path, proxmox) -> None:  # type: ignore[no-untyped-def]
    """`dflash stop` is waiting for a job that ignores SIGINT when the container is stopped:
    the next command at the container fails with ContainerStopped and its fix."""
    project = tmp_path / "project"
    project.mkdir()
    proxmox.create(240)
    root, checkpoints = container_defaults(proxmox, 240, project)
    where = Where("proxmox", project, ["--host", proxmox.alias, "--ct", "240"], root,
                  checkpoints, f"dft-{uuid.uuid4().hex[:10]}")  # fmt: skip
    where.config("trap '' INT TERM; echo up; sleep 60")
    assert where.run("deploy", *where.flags).returncode == 0
    end = time.monotonic() + 30
    log = where.checkpoints / "train_stdout.log"
    while not (log.exists() and "up" in log.read_text()) and time.monotonic() < end:
        time.sleep(0.2)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_ops", "stop"], cwd=project, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    lock = root / "deploy.lock"  # appears once `stop` has opened the container and acts
    end = time.monotonic() + 30
    while not lock.is_symlink() and time.monotonic() < end:
        time.sleep(0.02)
    assert lock.is_symlink()
    time.sleep(1.0)  # inside the 3 s SIGINT grace period of the job
    proxmox.stop(240)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "Traceback" not in err, err
    assert "Container 240" in err and "not running" in err and "pct start 240" in err
