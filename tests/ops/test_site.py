"""The site program's interface (`dflash_ops/remote/site.sh`): the values the client and the
program share agree, and a call the program does not know is refused before it acts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash_ops.connect.place import HostPlace
from dflash_ops.connect.transport import LocalTransport
from dflash_ops.errors import ReleaseError
from dflash_ops.remote import checkpoints, client, job, release
from tests.site_helpers import Site, site_fixture, tmux_socket_fixture  # noqa: F401


def constant(name: str) -> str:
    found = re.search(rf"^readonly {name}=(\S+)", client.SITE, re.MULTILINE)
    assert found is not None, name
    return found.group(1).strip("'")


def test_the_client_and_the_program_agree_on_shared_values() -> None:
    assert int(constant("HELD")) == client.HELD
    assert int(constant("PREFLIGHT")) == client.PREFLIGHT
    assert int(constant("RUNNING")) == job.RUNNING
    assert int(constant("MOVED")) == client.MOVED
    assert job._NOT_CLOSED in client.SITE  # the stop step's words for a session left open
    assert constant("COMPLETE") == release.COMPLETE
    assert constant("ARCHIVE") == checkpoints.ARCHIVE
    assert constant("FORMAT") == job._FORMAT  # the state line job.py parses
    assert checkpoints.RUN_PATTERN in client.SITE  # what prune-run proves a run is


@pytest.mark.parametrize(
    ("words", "said"),
    [
        (["nonsense"], "unknown command nonsense"),
        ([], "unknown command (none)"),
        (["stop", "--no-such", "x"], "unknown option --no-such"),
        (["stop", "--root"], "--root needs a value"),
        (["stop", "stray"], "unexpected argument stray"),
    ],
)
def test_an_unknown_call_is_refused_before_anything(
    tmp_path: Path, words: list[str], said: str
) -> None:
    root = tmp_path / "root"
    argv = ["bash", "-c", client.SITE, "dflash-site", *words]
    if words[:1] == ["stop"]:
        argv = argv[:4] + ["stop", "--lock", str(root / "deploy.lock")] + words[1:]
    result = HostPlace(LocalTransport()).run(argv, check=False)
    assert result.exit_code == 2 and said in result.stderr_text
    assert not root.exists()  # no lock taken, nothing created


def test_restart_with_nothing_deployed_says_so_and_changes_nothing(site: Site) -> None:
    """The `current` step fails: the client's table turns it into the release layer's error."""
    with pytest.raises(ReleaseError, match="Nothing is deployed") as err:
        site.restart()
    assert "dflash deploy" in (err.value.hint or "")
    assert not Path(site.plan.lock.path).is_symlink()  # the program released its lock
    assert not site.job.state().exists
