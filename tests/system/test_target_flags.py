"""`--host`/`--ct` on the command line keep the rest of deploy.toml's table: the README's own
`dflash deploy --host pve --ct 200` against the `pct` stand-in, with a `[target]` written by
`dflash init` for that container and then given its own `python`, `root` and `checkpoints`.
The flags are remembered, so a later plain `dflash doctor` must see the same table."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from tests.cli_helpers import dflash, wait_for

CT = 200
PYTHON = "/usr/bin/python3.11"  # in the container (its /usr is the host's), not the default


def target_table(proxmox, *, host: str) -> str:  # type: ignore[no-untyped-def]
    return (
        f'[target]\nplace = "proxmox"\nhost = "{host}"\nct = {CT}\n'
        f'python = "{PYTHON}"\nroot = "/workspace/dflash-root"\ncheckpoints = "/workspace/ck"\n'
    )


def write_project(tmp_path: Path, target: str) -> Path:
    project = tmp_path / "project"
    project.mkdir(exist_ok=True)
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    (project / "deploy.toml").write_text(
        f"{target}\n[job]\nsocket = {json.dumps(socket)}\nstop_timeout = 3\n"
        'command = "echo python=$DFLASH_PYTHON; exec sleep 600"\n\n[train]\ndemo = true\n'
    )
    return project


def test_readme_host_and_ct_flags_keep_the_target_table(tmp_path: Path, proxmox) -> None:  # type: ignore[no-untyped-def]
    proxmox.create(CT)
    project = write_project(tmp_path, target_table(proxmox, host=proxmox.alias))
    deployed = dflash(project, "deploy", "--host", proxmox.alias, "--ct", str(CT))
    assert deployed.returncode == 0, deployed.stderr
    workspace = proxmox.workspace_dir(CT)
    log = wait_for(workspace / "ck" / "train_stdout.log", "python=")
    assert log.startswith(f"python={PYTHON}\n")  # [target]'s python, not the default python3
    assert (workspace / "dflash-root" / "current").is_symlink()  # [target]'s root
    assert "note:" not in deployed.stderr  # the flags named [target]'s own place: nothing to say

    # The flags are remembered: doctor without flags checks the same table's python.
    checked = dflash(project, "doctor", "--json", "--no-gpu-smoke", "--min-free-gib", "0")
    report = json.loads(checked.stdout)
    python = next(c for c in report["checks"] if c["name"] == "python")
    assert python["ok"] and python["detail"].startswith(f"{PYTHON}: Python "), python
    assert report["place"] == f"ct {CT} on {proxmox.alias}"
    assert dflash(project, "stop").returncode == 0


def test_flags_for_another_place_say_which_table_gave_the_rest(tmp_path: Path, proxmox) -> None:  # type: ignore[no-untyped-def]
    """[target] names another node (an alias of the same sshd): the flags replace its host,
    its python/root/checkpoints still apply, and one line says so."""
    proxmox.create(CT)
    project = write_project(tmp_path, target_table(proxmox, host="pve-old"))
    deployed = dflash(project, "deploy", "--host", proxmox.alias, "--ct", str(CT))
    assert deployed.returncode == 0, deployed.stderr
    notes = [line for line in deployed.stderr.splitlines() if "[target]" in line]
    assert len(notes) == 1, deployed.stderr
    assert "pve-old" in notes[0] and "python, root, checkpoints" in notes[0]
    log = wait_for(proxmox.workspace_dir(CT) / "ck" / "train_stdout.log", "python=")
    assert log.startswith(f"python={PYTHON}\n")
    later = dflash(project, "status", "--json")  # remembered flags: no note again
    assert later.returncode == 0 and "[target]" not in later.stderr, later.stderr
    assert dflash(project, "stop").returncode == 0
