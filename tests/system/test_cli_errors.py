"""Failures as the user sees them: one message naming the problem, a hint, a non-zero exit,
never a traceback. And `--help` with an example on every command."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_ops.cli import app
from tests.cli_helpers import dflash, kill_tmux_server

COMMANDS = ["deploy", "logs", "status", "restart", "stop", "checkpoints"]


def check_failure(result, *words: str) -> None:  # type: ignore[no-untyped-def]
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ")
    assert "hint: " in result.stderr
    for word in words:
        assert word in result.stderr


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_an_example(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"])
    assert result.exit_code == 0
    assert "Examples:" in result.output and f"dflash {command}" in result.output


def test_root_help_lists_commands() -> None:
    result = CliRunner().invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.output


def test_unknown_key_names_key_and_file(tmp_path: Path) -> None:
    (tmp_path / "deploy.toml").write_text("[job]\ngpu = 2\n")
    check_failure(dflash(tmp_path, "status"), "'job.gpu'", str(tmp_path / "deploy.toml"))


def test_wrong_type_names_key_and_file(tmp_path: Path) -> None:
    (tmp_path / "deploy.toml").write_text('[targets.box]\nplace = "ssh"\nport = "22"\n')
    check_failure(dflash(tmp_path, "status"), "'targets.box.port'", "deploy.toml")


def test_missing_target_name(tmp_path: Path) -> None:
    (tmp_path / "deploy.toml").write_text("")
    check_failure(dflash(tmp_path, "deploy", "--target", "gpu"), "'gpu'", "--target")


def test_ct_without_host(tmp_path: Path) -> None:
    (tmp_path / "deploy.toml").write_text("")
    check_failure(dflash(tmp_path, "deploy", "--ct", "200"), "--ct needs --host")


def test_no_config(tmp_path: Path) -> None:
    check_failure(dflash(tmp_path, "status"), "No config file", "deploy.toml")


def test_config_flag_and_env(tmp_path: Path) -> None:
    other = tmp_path / "elsewhere.toml"
    other.write_text("[job]\nbad = 1\n")
    check_failure(dflash(tmp_path, "--config", str(other), "status"), str(other))


def test_hostile_session_name_is_refused_before_anything_runs(tmp_path: Path) -> None:
    canary = tmp_path / "canary"
    (tmp_path / "deploy.toml").write_text(
        f'[job]\nsession = "x; touch {canary}"\ncommand = "touch {canary}"\n'
    )
    check_failure(dflash(tmp_path, "deploy"), "'job.session'")
    assert not canary.exists() and not (tmp_path / ".dflash").exists()


def test_restart_before_deploy(tmp_path: Path) -> None:
    (tmp_path / "deploy.toml").write_text('[job]\nsocket = "dft-never"\ncommand = "true"\n')
    check_failure(dflash(tmp_path, "restart"), "Nothing is deployed")


def test_deploy_without_trainer_or_command(tmp_path: Path) -> None:
    (tmp_path / "deploy.toml").write_text('[job]\nsocket = "dft-never"\n')
    check_failure(dflash(tmp_path, "deploy"), "__main__.py")
    assert not (tmp_path / ".dflash" / "local" / "releases").exists()


def test_usage_error_is_not_a_traceback(tmp_path: Path) -> None:
    result = dflash(tmp_path, "deploy", "--ct", "abc")
    assert result.returncode == 2 and "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["doctor", "status"])
def test_without_the_ssh_client_a_remote_target_says_how_to_install_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, command: str
) -> None:
    """The SSH configuration is read through `ssh -G`: no client, one error with the install."""
    bare = tmp_path / "bin"
    bare.mkdir()
    monkeypatch.setenv("PATH", str(bare))
    (tmp_path / "deploy.toml").write_text(
        '[target]\nplace = "ssh"\nhost = "gpu-box"\n[job]\ncommand = "true"\n[train]\ndemo = true\n'
    )
    result = dflash(tmp_path, command)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    said = result.stdout + result.stderr
    assert "The ssh client is not installed" in said and "openssh-client" in said


def test_a_release_without_the_trainer_entry_is_named_not_run(tmp_path: Path) -> None:
    """`eval`, `plan` and `export` run `python -m trainer VERB` in the current release: one
    deployed by an earlier dflash (a rollback reaches it: `trainer/` without `__main__.py`) or one
    without a trainer is refused naming the release and what to do, before anything runs."""
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "__main__.py").write_text("print('trainer')\n")
    (tmp_path / "deploy.toml").write_text(
        f'[job]\nsocket = "{socket}"\ncommand = "echo up; exec sleep 600"\n'
    )
    try:
        deployed = dflash(tmp_path, "deploy", "--no-wait")
        assert deployed.returncode == 0, deployed.stderr
        trainer = tmp_path / ".dflash" / "local" / "current" / "trainer"
        (trainer / "__main__.py").unlink()  # as a release of an earlier dflash has it
        for args in (["eval"], ["plan", "--force"], ["export", "--to", str(tmp_path / "d")]):
            check_failure(dflash(tmp_path, *args), "was deployed by an earlier dflash",
                          "python -m trainer", "Deploy again")  # fmt: skip
        trainer.rmdir()
        check_failure(dflash(tmp_path, "plan", "--force"), "has no trainer", "[job] command")
        assert not (tmp_path / "d").exists()
    finally:
        kill_tmux_server(socket)
