"""A deploy whose `[train]` the trainer's own check refuses changes nothing at the place: the
running job keeps running in the same tmux session, `current`, the releases, the checkpoints
and the lock stay as they were, and the error names the key or the file. Through this machine
and through the loopback sshd, with real tmux and files; `dflash doctor` says the same."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflash_ops.remote.lock import LOCK_NAME
from tests.cli_helpers import REPO, Where, kill_tmux_server
from trainer.data.formats import Sample, write_samples
from trainer.settings.config import DemoConfig
from trainer.setup.demo import build_target, build_tokenizer


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("deploy-check") / "target"
    build_target(folder, DemoConfig(enabled=True, num_layers=4))
    build_tokenizer(folder)
    return folder


@pytest.fixture(params=["local", "ssh"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Where]:
    project = tmp_path / "project"
    project.mkdir()
    sock = f"dft-{uuid.uuid4().hex[:10]}"
    if request.param == "local":
        root = project / ".dflash" / "local"
        place = Where("local", project, [], root, root / "checkpoints", sock)
    else:
        request.getfixturevalue("ssh_home")
        root, ckpt = tmp_path / "root", tmp_path / "ckpt"
        place = Where("ssh", project, ["--target", "box"], root, ckpt, sock)
        place.targets = (
            f'[targets.box]\nplace = "ssh"\nhost = "testbox"\nroot = "{root}"\n'
            f'checkpoints = "{ckpt}"\npython = "{sys.executable}"\n'
        )
    yield place
    kill_tmux_server(sock)


def train_table(target: Path, data: Path, extra: str = "") -> str:
    return f'[train.model]\ntarget = "{target}"\n[train.data]\npath = "{data}"\n{extra}'


def configure(where: Where, train: str) -> None:
    """A project with the trainer, a job that stays up (`sleep`) and the given `[train]`."""
    trainer = where.project / "trainer"
    if not trainer.exists():
        shutil.copytree(REPO / "trainer", trainer, ignore=shutil.ignore_patterns("__pycache__"))
    where.config("echo up; exec sleep 120")
    text = (where.project / "deploy.toml").read_text().replace("[train]\ndemo = true\n", "")
    (where.project / "deploy.toml").write_text(text + train)


def snapshot(where: Where) -> dict[str, object]:
    status = where.status()
    return {
        "running": status["running"],
        "started_at": status["started_at"],
        "session": status["session"],
        "pane_pid": subprocess.run(
            ["tmux", "-L", where.socket, "list-panes", "-a", "-F", "#{pane_pid}"],
            capture_output=True,
            text=True,
        ).stdout.split(),
        "current": os.readlink(where.root / "current"),
        "releases": where.releases(),
        "checkpoints": sorted(p.name for p in where.checkpoints.iterdir()),
    }


def tokens(tmp_path: Path) -> Path:
    data = tmp_path / "tokens.jsonl"
    write_samples(data, [Sample([1, 2, 3, 4], [False, True, True, True])] * 4)
    return data


def healthy(where: Where, target: Path, data: Path) -> dict[str, object]:
    """A deployed job running, one checkpoint folder; what the place looks like."""
    configure(where, train_table(target, data))
    first = where.run("deploy", *where.flags)
    assert first.returncode == 0, first.stderr
    (where.checkpoints / "step-00000100").mkdir()
    before = snapshot(where)
    assert before["running"] and before["pane_pid"]
    return before


def refused(where: Where, train: str) -> str:
    """Deploy `train`; it must fail with exit 1 and no traceback. Its stderr."""
    configure(where, train)
    result = where.run("deploy", *where.flags)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert "nothing there changed" in result.stderr and "hint:" in result.stderr
    return result.stderr


def test_a_typo_in_train_fails_the_deploy_and_the_job_keeps_running(
    where: Where, target: Path, tmp_path: Path
) -> None:
    data = tokens(tmp_path)
    before = healthy(where, target, data)
    err = refused(where, train_table(target, data, "[train.run]\nnonsense_typo = 1\n"))
    assert "[train] run.nonsense_typo: unknown key" in err
    assert snapshot(where) == before  # same session, same start, current, releases, checkpoints
    assert not (where.root / LOCK_NAME).is_symlink()
    assert not list((where.root / "releases").glob("*.tmp"))
    assert where.run("stop", *where.flags).returncode == 0


def test_a_bad_data_line_or_a_missing_file_fails_the_deploy(target: Path, tmp_path: Path) -> None:
    project = tmp_path / "project"
    project.mkdir()
    root = project / ".dflash" / "local"
    where = Where("local", project, [], root, root / "checkpoints", f"dft-{uuid.uuid4().hex[:10]}")
    try:
        data = tokens(tmp_path)
        before = healthy(where, target, data)
        bad = tmp_path / "bad.jsonl"
        bad.write_text(data.read_text() + '{"input_ids": [1, 2]}\n')
        err = refused(where, train_table(target, bad))
        assert f"[train] data.path: {bad}:5: a tokenized line needs the key 'loss_mask'" in err
        assert snapshot(where) == before
        missing = tmp_path / "missing.jsonl"
        err = refused(where, train_table(target, missing))
        assert f"[train] data.path: {missing} does not exist" in err and "free space" not in err
        assert snapshot(where) == before
        configure(where, "")  # a [job] command and no [train]: nothing for the trainer to check
        result = where.run("deploy", *where.flags)
        assert result.returncode == 0, result.stderr
    finally:
        kill_tmux_server(where.socket)


def test_doctor_runs_the_same_check_at_the_place(
    target: Path, tmp_path: Path, ssh_home: object
) -> None:
    project = tmp_path / "project"
    project.mkdir()
    where = Where("ssh", project, ["--target", "box"], tmp_path / "root", tmp_path / "ck", "x")
    where.targets = (
        f'[targets.box]\nplace = "ssh"\nhost = "testbox"\nroot = "{where.root}"\n'
        f'checkpoints = "{where.checkpoints}"\npython = "{sys.executable}"\n'
    )

    def doctor(data: Path) -> dict[str, str]:
        configure(where, train_table(target, data))
        result = where.run(
            "doctor", "--no-gpu-smoke", "--json", "--min-free-gib", "0", *where.flags
        )
        checks = json.loads(result.stdout)["checks"]
        (check,) = [c for c in checks if c["name"] == "train config"]
        return check

    good = doctor(tokens(tmp_path))
    assert good["ok"], good
    assert f"target {target}: qwen3, 4 layers" in good["detail"]
    assert "tokenized JSONL, the first 4 lines parse" in good["detail"]
    bad = doctor(tmp_path / "missing.jsonl")
    assert (
        not bad["ok"] and f"data.path: {tmp_path / 'missing.jsonl'} does not exist" in bad["detail"]
    )
    assert f"Fix [train] in {where.project / 'deploy.toml'}" in bad["fix"]
    assert not list((where.root / "doctor").iterdir())  # the scratch folder is gone


def test_the_fix_names_the_config_file_and_no_trainer_option(target: Path, tmp_path: Path) -> None:
    """The trainer's own hint speaks of its command line (`--set KEY=VALUE`): dflash has no
    such option, so the fix says where the key is, in the file the settings came from."""
    project = tmp_path / "project"
    project.mkdir()
    where = Where("local", project, [], project / ".dflash" / "local", tmp_path / "ck", "x")
    configure(where, train_table(target, tokens(tmp_path), "[train.run]\nnonsense_typo = 1\n"))
    other = project / "other.toml"
    (project / "deploy.toml").rename(other)
    for command in ("deploy", "doctor"):
        result = where.run("--config", "other.toml", command)
        assert result.returncode == 1, result.stderr
        text = result.stdout + result.stderr
        assert f"Change that key under [train] in {other}" in text, text
        assert f"Fix [train] in {other}" in text and "--set" not in text
