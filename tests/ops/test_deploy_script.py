"""`dflash deploy` as one remote command (the site program, `remote/site.sh`), with real parts: the loopback sshd
(whose log counts the commands a deploy ran), the `pct` stand-in, real tmux and files.

Counted, not timed: a deploy, a restart and a stop at an SSH host or in a container are ONE
command each on ONE connection; a held lock costs the lock's own commands and one more run. The failure paths
(a live holder, a stale one, `--force`, no python, a broken tarball) raise the step's own
error and leave `current`, the running job and the lock as they were."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_ops.commands.operations import launch_argv
from dflash_ops.commands.workspace import Workspace
from dflash_ops.errors import ReleaseError
from dflash_ops.remote import client
from dflash_ops.remote.launch import LaunchPlan
from dflash_ops.remote.lock import LOCK_NAME
from dflash_ops.remote.release import build_bundle, new_release_id
from dflash_ops.settings.deploy_config import TargetFlags
from tests.cli_helpers import Where, kill_tmux_server, remote_where

CT = 210


def sessions(sshd) -> tuple[int, int]:  # type: ignore[no-untyped-def]
    """(connections accepted, commands started) in the server's log so far."""
    text = sshd.log_path.read_text(errors="replace")
    return text.count("Accepted publickey"), len(re.findall(r"Starting session: command", text))


@pytest.fixture(params=["ssh", "proxmox"])
def remote(request: pytest.FixtureRequest, tmp_path: Path, ssh_home: object) -> Iterator[Where]:
    yield from remote_where(request, tmp_path, CT)


def deploy_counted(
    where: Where, sshd, *args: str
) -> tuple[subprocess.CompletedProcess[str], int, int]:  # type: ignore[no-untyped-def]
    before = sessions(sshd)
    result = where.run("deploy", *where.flags, *args)
    after = sessions(sshd)
    return result, after[0] - before[0], after[1] - before[1]


def test_a_deploy_is_one_command_on_one_connection(remote: Where, sshd) -> None:  # type: ignore[no-untyped-def]
    remote.config('echo "run of $DFLASH_RELEASE"; sleep 60')
    first, conns, commands = deploy_counted(remote, sshd)
    assert first.returncode == 0, first.stderr
    assert (conns, commands) == (1, 1)
    (release,) = remote.releases()
    assert remote.status()["running"]

    (remote.checkpoints / "step-1.pt").write_text("weights")
    second, conns, commands = deploy_counted(remote, sshd)  # stops, archives, starts: still one
    assert second.returncode == 0, second.stderr
    assert (conns, commands) == (1, 1)
    assert "Stopped the previous job" in second.stdout + second.stderr
    (stamp,) = (remote.checkpoints / "archive").iterdir()
    assert (stamp / "step-1.pt").read_text() == "weights"
    assert not (remote.root / LOCK_NAME).is_symlink()
    report = remote.status()
    assert report["running"] and report["release"] == remote.releases()[-1] != release

    for command in (["restart"], ["restart", "--clean"], ["stop"]):  # one command each, too
        before = sessions(sshd)
        result = remote.run(*command)
        after = sessions(sshd)
        assert result.returncode == 0, result.stderr
        assert (after[0] - before[0], after[1] - before[1]) == (1, 1), command
    assert len(list((remote.checkpoints / "archive").iterdir())) == 2
    assert not remote.status()["exists"]


def holder(**changes: object) -> str:
    record = {
        "by": "ann@elsewhere",
        "host": "elsewhere",
        "pid": 4242,
        "since": time.time(),
        "doing": "deploy",
        "token": "feedbeef",
    }
    return json.dumps(record | changes, separators=(",", ":"), sort_keys=True)


def test_a_live_holder_fails_the_deploy_naming_it_and_force_takes_over(  # type: ignore[no-untyped-def]
    remote: Where, sshd
) -> None:
    remote.config("echo up; exec sleep 60", extra="lock_wait = 0.5\n")
    remote.root.mkdir(parents=True, exist_ok=True)
    record = holder()
    (remote.root / LOCK_NAME).symlink_to(record)
    held, _, _ = deploy_counted(remote, sshd)
    assert held.returncode == 1 and "Traceback" not in held.stderr
    assert "deploy lock" in held.stderr and "ann@elsewhere" in held.stderr
    assert "--force" in held.stderr
    assert os.readlink(remote.root / LOCK_NAME) == record  # untouched
    assert not (remote.root / "releases").exists()  # nothing unpacked, nothing switched

    forced, conns, commands = deploy_counted(remote, sshd, "--force")
    assert forced.returncode == 0, forced.stderr
    assert "Taking over the deploy lock" in forced.stderr and "ann@elsewhere" in forced.stderr
    # the held run, then the run that takes the judged record over and holds the lock
    assert (conns, commands) == (1, 2)
    assert not (remote.root / LOCK_NAME).is_symlink()
    assert remote.status()["running"]
    assert remote.run("stop").returncode == 0


def test_a_stale_lock_is_taken_over_with_a_warning(remote: Where) -> None:
    remote.config("echo up; exec sleep 60")
    remote.root.mkdir(parents=True, exist_ok=True)
    gone = subprocess.Popen(["true"])
    gone.wait()
    stale = holder(host=socket.gethostname(), pid=gone.pid)  # this machine, process gone
    (remote.root / LOCK_NAME).symlink_to(stale)
    result = remote.run("deploy", *remote.flags)
    assert result.returncode == 0, result.stderr
    assert "Taking over the deploy lock" in result.stderr and "no longer exists" in result.stderr
    assert not (remote.root / LOCK_NAME).is_symlink()
    assert remote.run("stop").returncode == 0


def test_a_python_that_does_not_run_stops_before_anything(remote: Where, sshd) -> None:  # type: ignore[no-untyped-def]
    if remote.kind == "ssh":
        remote.targets += 'python = "/opt/no-such/python3"\n'
        flags: list[str] = []
    else:
        remote.targets = (
            f'[targets.ct]\nplace = "proxmox"\nhost = "pvehost"\nct = {CT}\n'
            'python = "/opt/no-such/python3"\n'
        )
        flags = ["--target", "ct"]
    remote.config("echo up; exec sleep 60")
    before = sessions(sshd)
    result = remote.run("deploy", *(flags or remote.flags))
    assert sessions(sshd)[1] - before[1] == 1
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "error: python: /opt/no-such/python3 does not run" in result.stderr
    assert 'set python = "/path/to/python"' in result.stderr
    assert not (remote.root / "releases").exists() and not (remote.root / LOCK_NAME).exists()


def test_a_broken_tarball_leaves_current_and_the_job(remote: Where) -> None:
    """Through `client.run` with a bundle that is not a tar: the unpack fails with the
    release layer's error; `current`, the running job and the checkpoints stay; the lock goes."""
    remote.config('echo "run of $DFLASH_RELEASE"; sleep 60')
    assert remote.run("deploy", *remote.flags).returncode == 0
    (good,) = remote.releases()
    before = remote.status()
    (remote.checkpoints / "step-1.pt").write_text("weights")
    cwd = os.getcwd()
    os.chdir(remote.project)
    ws = Workspace.load(config_file=None, flags=TargetFlags())
    try:
        plan = client.DeployPlan(
            releases=ws.releases(),
            job=ws.job(),
            lock=ws.lock(),
            checkpoints=ws.checkpoints(),
            launch=launch_argv(ws),
            cwd=f"{ws.target.root}/current",
            env=dict(ws.config.job.env),
        )
        launch = LaunchPlan(
            release_id=new_release_id(),
            python="python3",
            checkpoints=ws.target.checkpoints,
            command="true",
        )
        bundle = build_bundle(ws.config.project_dir, plan=launch, train={}, target="x")
        broken = type(bundle)(release_id=bundle.release_id, data=b"not a tar\n" * 200, meta={})
        with pytest.raises(ReleaseError, match="Could not unpack") as err:
            client.run(plan, client.Steps(doing="deploy", bundle=broken))
        assert "current release is unchanged" in err.value.hint
    finally:
        ws.close()
        os.chdir(cwd)
    assert os.readlink(remote.root / "current") == f"releases/{good}"
    after = remote.status()
    assert after["running"] and after["started_at"] == before["started_at"]
    assert (remote.checkpoints / "step-1.pt").read_text() == "weights"
    assert not (remote.root / LOCK_NAME).is_symlink()
    assert remote.run("stop").returncode == 0


def test_local_deploy_is_one_command(tmp_path: Path) -> None:
    """This machine: the same script through a subprocess, one `run` at the place."""
    from bench.bench_cli import CountingPlace
    from dflash_ops.commands import operations
    from dflash_ops.commands.workspace import open_place

    project = tmp_path / "project"
    project.mkdir()
    sock = f"dft-{uuid.uuid4().hex[:10]}"
    root = project / ".dflash" / "local"
    where = Where("local", project, [], root, root / "checkpoints", sock)
    where.config("echo up; exec sleep 60")
    cwd = os.getcwd()
    os.chdir(project)
    try:
        for _ in range(2):
            ws = Workspace.load(config_file=None, flags=TargetFlags())
            place = CountingPlace(open_place(ws.target))
            ws._place = place
            try:
                report = operations.deploy(ws)
            finally:
                ws.close()
            assert [label for label, _ in place.trips] == ["dflash-deploy"]
            assert report.started.running
        assert report.stopped is not None and report.stopped.exit_code == 130
        assert len(where.releases()) == 2
    finally:
        os.chdir(cwd)
        kill_tmux_server(sock)
