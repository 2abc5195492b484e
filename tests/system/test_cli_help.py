"""Every command's --help shows an example, and shell completion works for bash, zsh and fish."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer

from dflash_ops.cli import app

REPO = Path(__file__).resolve().parents[2]


def _commands(group: object, prefix: tuple[str, ...] = ()) -> list[str]:
    """Every command path, subcommands of groups included ("checkpoints prune")."""
    names = []
    for name, command in sorted(getattr(group, "commands", {}).items()):
        names.append(" ".join((*prefix, name)))
        names += _commands(command, (*prefix, name))
    return names


COMMANDS = _commands(typer.main.get_command(app))


def dflash(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ, PYTHONPATH=str(REPO), **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "dflash_ops", *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_every_command_is_listed():
    assert {"init", "doctor", "deploy", "logs", "status", "stop", "restart"} <= set(COMMANDS)


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_shows_an_example(command):
    args = ["--help"] if command is None else [*command.split(), "--help"]
    result = dflash(*args)
    assert result.returncode == 0, result.stderr
    text = result.stdout
    example = "Quick start" if command is None else "Examples:"
    assert example in text
    assert f"dflash {command or 'deploy'}" in text.split(example, 1)[1]


def test_root_help_documents_completion():
    text = dflash("--help").stdout
    assert "--install-completion" in text and "--show-completion" in text


def test_bash_completion_of_a_command_name():
    result = dflash(
        env={"_DFLASH_COMPLETE": "complete_bash", "COMP_WORDS": "dflash do", "COMP_CWORD": "1"}
    )
    assert result.stdout.split() == ["doctor"]


def test_zsh_completion_of_an_option():
    result = dflash(
        env={"_DFLASH_COMPLETE": "complete_zsh", "_TYPER_COMPLETE_ARGS": "dflash doctor --no-g"}
    )
    assert "--no-gpu-smoke" in result.stdout


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_show_completion_prints_a_script_for_the_shell(shell):
    result = dflash("--show-completion", shell)
    assert result.returncode == 0, result.stderr
    assert "_DFLASH_COMPLETE" in result.stdout


# Metavars typer makes from Python types: what a user cannot type.
PYTHON_TYPES = ("<str>", "<int", "<float", "<path>", "<list[", "<text>", "<bool>")


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_names_values_as_a_user_types_them(command):
    args = ["--help"] if command is None else [*command.split(), "--help"]
    text = dflash(*args).stdout
    assert not [t for t in PYTHON_TYPES if t in text], text


def test_choices_ranges_and_version_are_shown():
    assert "--dtype <bf16|fp16|fp32>" in dflash("export", "--help").stdout
    deploy = " ".join(dflash("deploy", "--help").stdout.split())
    assert "--ct CT Proxmox container id on --host, 100-999999999" in deploy
    assert "-p, --port PORT" in deploy and "[1<=x<=65535]" in deploy
    version = dflash("--version")
    assert version.returncode == 0 and version.stdout.startswith("dflash ")
