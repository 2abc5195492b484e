"""Every command end to end, as a user runs it (`python -m dflash_ops …` in a project folder),
on all three places: this machine, an SSH host (the loopback sshd), and a container on a
Proxmox node (the namespace-backed `pct` stand-in). Jobs are short shell commands."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_helpers import Where, container_defaults, kill_tmux_server

CT = 200


@pytest.fixture(params=["local", "ssh", "proxmox"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Where]:
    project = tmp_path / "project"
    project.mkdir()
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    kind = request.param
    if kind == "local":
        root = project / ".dflash" / "local"
        spot = Where(kind, project, [], root, root / "checkpoints", socket)
        spot.canary_at, spot.canary_host = str(tmp_path / "canary"), tmp_path / "canary"
    elif kind == "ssh":
        request.getfixturevalue("ssh_home")
        root, ckpt = tmp_path / "remote-root", tmp_path / "remote-ckpt"
        spot = Where(kind, project, ["--target", "box", "--host", "testbox"], root, ckpt, socket)
        spot.targets = (
            f'[targets.box]\nplace = "ssh"\nhost = "elsewhere"\n'
            f'root = "{root}"\ncheckpoints = "{ckpt}"\n'
        )
        spot.canary_at, spot.canary_host = str(tmp_path / "canary"), tmp_path / "canary"
    else:
        proxmox = request.getfixturevalue("proxmox")
        proxmox.create(CT)
        spot = Where(
            kind,
            project,
            ["--host", proxmox.alias, "--ct", str(CT)],
            *container_defaults(proxmox, CT, project),
            socket,
        )
        spot.canary_at, spot.canary_host = "/root/canary", proxmox.root_dir(CT) / "canary"
    yield spot
    if kind != "proxmox":  # a container's tmux ends with the container
        kill_tmux_server(socket)


def wait_for_log(where: Where, text: str, count: int = 1, timeout: float = 30) -> str:
    end = time.monotonic() + timeout
    log = where.checkpoints / "train_stdout.log"
    while time.monotonic() < end:
        content = log.read_text() if log.exists() else ""
        if content.count(text) >= count:
            return content
        time.sleep(0.2)
    raise AssertionError(f"{text!r} x{count} not in the log in time")


def test_deploy_logs_status(where: Where) -> None:
    where.config(
        'echo "alloc=$PYTORCH_CUDA_ALLOC_CONF greet=$GREETING"; echo "cwd=$PWD"; '
        "for i in 1 2 3; do echo line $i; "
        'echo "{\\"step\\": $i, \\"loss\\": 0.5, \\"tokens_per_s\\": 10, \\"time\\": $i}" '
        '>> "$DFLASH_CHECKPOINTS/metrics.jsonl"; sleep 0.2; done; '
        # a row torn by a kill in the middle of its write: status shows the last whole one
        'printf \'{"step": 4, "lo\' >> "$DFLASH_CHECKPOINTS/metrics.jsonl"; exit 3',
        env={"GREETING": "hi there"},
    )
    deployed = where.run("deploy", *where.flags)
    assert deployed.returncode == 0, deployed.stderr
    followed = where.run("logs", "--follow")  # no flags: the remembered target
    assert followed.returncode == 3, followed.stderr
    assert "alloc=expandable_segments:True greet=hi there\n" in followed.stdout
    assert followed.stdout.count("line 3\n") == 1

    (release,) = where.releases()
    report = where.status()
    assert report["session"] == "dflash" and report["release"] == release
    assert (report["exists"], report["running"], report["exit_code"]) == (True, False, 3)
    assert report["last_lines"][-1] == "line 3"
    assert report["metrics"] == {"step": 3, "loss": 0.5, "tokens_per_s": 10, "time": 3}
    assert (where.root / "current").resolve() == (where.root / "releases" / release).resolve()
    folder = where.root / "releases" / release
    assert {p.name for p in folder.iterdir()} >= {"launch.sh", "train.toml", "RELEASE.json"}
    assert (folder / "train.toml").read_text() == "demo = true\n"
    assert json.loads((folder / "RELEASE.json").read_text())["id"] == release
    assert f"/releases/{release}\n" in followed.stdout  # the job ran inside its release

    human = where.run("status")  # piped: plain text, no colour codes
    assert human.returncode == 0 and "\x1b[" not in human.stdout
    assert "exited with code 3" in human.stdout and "loss 0.5000" in human.stdout
    assert f"release  {release}" in human.stdout

    tail = where.run("logs", "--tail", "1")
    assert tail.returncode == 0 and tail.stdout == "line 3\n"


def test_redeploy_archives_resume_keeps_and_five_releases_stay(where: Where) -> None:
    where.config('echo "run of $DFLASH_RELEASE"')
    assert where.run("deploy", *where.flags).returncode == 0
    first = where.releases()[0]
    wait_for_log(where, f"run of {first}")
    (where.checkpoints / "step-100.pt").write_text("weights")

    assert where.run("deploy").returncode == 0  # fresh run: everything archived, nothing lost
    second = where.releases()[-1]
    log = wait_for_log(where, f"run of {second}")
    assert log == f"run of {second}\n"  # the new log starts fresh
    (stamp,) = (where.checkpoints / "archive").iterdir()
    assert (stamp / "step-100.pt").read_text() == "weights"
    assert (stamp / "train_stdout.log").read_text() == f"run of {first}\n"

    (where.checkpoints / "step-200.pt").write_text("more")
    assert where.run("deploy", "--resume").returncode == 0
    third = where.releases()[-1]
    log = wait_for_log(where, f"run of {third}")
    assert log == f"run of {second}\nrun of {third}\n"  # appended
    assert (where.checkpoints / "step-200.pt").exists()
    assert len(list((where.checkpoints / "archive").iterdir())) == 1

    listed = where.run("checkpoints", "--json")
    assert listed.returncode == 0, listed.stderr
    listing = json.loads(listed.stdout)
    assert {e["name"] for e in listing["live"]} == {"step-200.pt", "train_stdout.log"}
    assert [e["name"] for e in listing["archived"][stamp.name]] == [
        "step-100.pt",
        "train_stdout.log",
    ]

    for _ in range(3):
        assert where.run("deploy", "--resume").returncode == 0
    kept = where.releases()
    assert len(kept) == 5 and first not in kept
    assert where.status()["release"] == kept[-1]


def test_stop_restart_and_clean(where: Where) -> None:
    where.config('trap "echo got-int; exit 5" INT; echo started; while true; do sleep 0.1; done')
    assert where.run("deploy", *where.flags).returncode == 0
    wait_for_log(where, "started")
    report = where.status()
    assert report["running"] and report["exit_code"] is None

    stopped = where.run("stop")
    assert stopped.returncode == 0, stopped.stderr
    assert "exit 5" in stopped.stderr
    assert not where.status()["exists"]
    assert "got-int" in (where.checkpoints / "train_stdout.log").read_text()
    again = where.run("stop")
    assert again.returncode == 0 and "nothing to stop" in again.stderr

    assert where.run("restart").returncode == 0  # resumes: the log goes on
    wait_for_log(where, "started", count=2)
    assert where.status()["running"]

    assert where.run("restart", "--clean").returncode == 0
    wait_for_log(where, "started")
    archived = [p / "train_stdout.log" for p in (where.checkpoints / "archive").iterdir()]
    assert len(archived) == 1 and archived[0].read_text().count("started") == 2
    assert (where.checkpoints / "train_stdout.log").read_text().count("started") == 1
    assert where.run("stop").returncode == 0


HOSTILE = [
    "$(touch CANARY)",
    "`touch CANARY`",
    "a; touch CANARY",
    "x;",
    "'\"; touch CANARY #",
    "l1\nl2",
]


def test_hostile_env_values_pass_literally(where: Where) -> None:
    values = {f"V{i}": v.replace("CANARY", where.canary_at) for i, v in enumerate(HOSTILE)}
    printer = "; ".join(f'printf "[%s]\\n" "${key}"' for key in values)
    where.config(printer, env=values)
    assert where.run("deploy", *where.flags).returncode == 0
    followed = where.run("logs", "--follow")
    assert followed.returncode == 0, followed.stderr
    assert followed.stdout == "".join(f"[{v}]\n" for v in values.values())
    assert not where.canary_host.exists()
