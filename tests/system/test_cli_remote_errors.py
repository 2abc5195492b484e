"""What a user sees when the remote place is not what the command needs: an unknown host key,
a host without `pct`, a missing or stopped container. One message, a hint, exit 1."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_helpers import dflash


@pytest.fixture
def project(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "deploy.toml").write_text('[job]\nsocket = "dft-remote-errors"\ncommand = "true"\n')
    return folder


def failure(project: Path, *args: str) -> str:
    result = dflash(project, *args)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr and "hint: " in result.stderr
    return result.stderr


def test_unknown_host_key_is_refused_with_its_fingerprint(project: Path, ssh_home, sshd) -> None:  # type: ignore[no-untyped-def]
    err = failure(project, "status", "--host", "unknownbox")
    assert sshd.host_key_fingerprint in err and "--accept-new-host-key" in err
    assert not (project / ".dflash" / "state.json").exists()


def test_host_without_pct(project: Path, proxmox) -> None:  # type: ignore[no-untyped-def]
    err = failure(project, "deploy", "--host", proxmox.no_pct_alias, "--ct", "200")
    assert "pct" in err and "Proxmox" in err


def test_missing_container(project: Path, proxmox) -> None:  # type: ignore[no-untyped-def]
    err = failure(project, "status", "--host", proxmox.alias, "--ct", "201")
    assert "201 does not exist" in err and "pct list" in err


def test_stopped_container(project: Path, proxmox) -> None:  # type: ignore[no-untyped-def]
    proxmox.create(202, running=False)
    err = failure(project, "deploy", "--host", proxmox.alias, "--ct", "202")
    assert "202" in err and "stopped" in err and "pct start 202" in err
    assert not (proxmox.root_dir(202) / "dflash").exists()


def test_container_id_must_be_valid(project: Path) -> None:
    err = failure(project, "status", "--host", "somewhere", "--ct", "7")
    assert err.startswith("error: --ct 7 is not a container id: Proxmox numbers containers 100")
    assert "hint: Pass the id that pct list shows" in err and "in the file" not in err
    err = failure(project, "init", "--host", "somewhere", "--ct", "42", "--force")
    assert err.startswith("error: --ct 42 is not a container id")
