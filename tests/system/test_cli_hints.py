"""Every failure's hint points the way out, as the real `python -m dflash_ops` prints it: the
missing config names `dflash init`, `--ct` without `--host` names the node for the command at
hand, invalid TOML points at its syntax, `--port` on a local target asks for a host, a removed
remembered target can be left with `--target default`, `logs --follow` before any deploy is an
`error:`/`hint:` pair, `--show-completion zsh` prints zsh's script, and a Ctrl-C while the
command starts is one line and exit code 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.cli_helpers import REPO, default_sigint, dflash


def project(tmp_path: Path, text: str = "") -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    socket = f"dft-hints-{tmp_path.name[-8:]}"
    body = text or f'[target]\nplace = "local"\n[job]\nsocket = "{socket}"\n[train]\ndemo = true\n'
    (folder / "deploy.toml").write_text(body)
    return folder


def hint(stderr: str) -> str:
    return next(line for line in stderr.splitlines() if line.startswith("hint:"))


def test_missing_config_names_dflash_init(tmp_path: Path) -> None:
    result = dflash(tmp_path, "status")
    assert result.returncode == 1 and "No config file" in result.stderr
    assert "dflash init" in hint(result.stderr)


def test_ct_without_host_names_the_node(tmp_path: Path) -> None:
    init = dflash(tmp_path, "init", "--ct", "200")
    assert init.returncode == 1
    assert (
        hint(init.stderr)
        == "hint: Name the node as well: dflash init --host <proxmox node> --ct <id>"
    )
    status = dflash(project(tmp_path), "status", "--ct", "200")
    assert status.returncode == 1 and "--host <proxmox node> --ct <id>" in hint(status.stderr)
    assert "dflash deploy" not in hint(status.stderr)  # not another command's


def test_invalid_toml_points_at_the_syntax(tmp_path: Path) -> None:
    folder = project(tmp_path, "[job]\nsession = dflash\n")
    result = dflash(folder, "status")
    assert result.returncode == 1 and "is not valid TOML" in result.stderr
    assert "Fix the syntax at that line" in hint(result.stderr)
    assert "named key" not in result.stderr


@pytest.mark.parametrize("flag", [["--port", "2222"], ["--user", "ann"]])
def test_ssh_flag_on_a_local_target_asks_for_a_host(tmp_path: Path, flag: list[str]) -> None:
    result = dflash(project(tmp_path), "status", *flag)
    assert result.returncode == 1, result.stderr
    assert f"{flag[0]} is for SSH targets" in result.stderr
    assert "Add --host HOST" in hint(result.stderr)


def test_a_removed_remembered_target_is_left_with_target_default(tmp_path: Path) -> None:
    folder = project(tmp_path)
    state = folder / ".dflash" / "state.json"
    state.parent.mkdir()
    state.write_text(json.dumps({"flags": {"target": "gone"}, "target": "x", "release": "r",
                                 "deployed_at": "2026-01-01T00:00:00+00:00"}))  # fmt: skip
    result = dflash(folder, "status")
    assert result.returncode == 1 and "'gone'" in result.stderr and "removed" in result.stderr
    assert "--target (default" in hint(result.stderr)
    chosen = dflash(folder, "status", "--target", "default", "--json")
    assert chosen.returncode == 0, chosen.stderr
    assert json.loads(chosen.stdout)["target"] == "default"


def test_follow_before_any_deploy_is_an_error_with_a_hint(tmp_path: Path) -> None:
    result = dflash(project(tmp_path), "logs", "--follow")
    assert result.returncode == 1
    assert result.stderr.splitlines()[0].startswith("error: No job deployed from here")
    assert hint(result.stderr).startswith("hint: ") and "dflash deploy" in hint(result.stderr)


@pytest.mark.parametrize(("shell", "marker"), [("zsh", "#compdef dflash"), ("fish", "complete ")])
def test_show_completion_prints_the_named_shells_script(tmp_path: Path, shell, marker) -> None:
    for args in (["--show-completion", shell], [f"--show-completion={shell}"]):
        result = dflash(tmp_path, *args)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(marker)


def test_ctrl_c_while_the_command_starts_is_one_line_and_130(tmp_path: Path) -> None:
    """The command's imports take a moment: a Ctrl-C then is no traceback through the importer.
    Signals are sent past the interpreter's own start (measured here), at several moments."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", "import dflash_ops"], env=env, check=True)
    bare = time.monotonic() - started  # the interpreter alone, as loaded as this machine is
    interrupted = 0
    for extra in (0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5):
        proc = subprocess.Popen(
            [sys.executable, "-m", "dflash_ops", "status"], cwd=tmp_path, env=env,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint,
        )  # fmt: skip
        time.sleep(bare + extra)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        if err == "Interrupted.\n":
            interrupted += 1
            assert proc.returncode == 130
        else:  # it was done already: the missing config said as ever (the signal may then
            # have come while the interpreter was ending: killed by it, nothing more printed)
            assert proc.returncode in (1, -signal.SIGINT) and "No config file" in err, err
    assert interrupted
