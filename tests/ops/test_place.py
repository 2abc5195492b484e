"""place.py: a host over ssh, and containers of the Proxmox stand-in reached with `pct exec`."""

from __future__ import annotations

import io
import tarfile
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_ops.connect.place import ContainerPlace, HostPlace, Place
from dflash_ops.connect.transport import LocalTransport, SSHTransport
from dflash_ops.errors import (
    ContainerNotFound,
    ContainerStopped,
    PctMissing,
    RemoteCommandFailed,
    UnsafeValue,
)
from tests.fixtures.proxmox import Proxmox
from tests.fixtures.ssh import SSHHome

CT = 200


def hostile(canary: str) -> list[str]:
    """Arguments that would create `canary` if any shell on the way interpreted them."""
    return [
        f"$(touch {canary})",
        f"`touch {canary}`",
        f"; touch {canary}",
        f"&& touch {canary} &&",
        f"| touch {canary}",
        f"\ntouch {canary}\n",
        f"'; touch {canary}; '",
        f'"; touch {canary}; "',
        f"$(IFS=_;touch_{canary})",
        f">{canary}",
        "--keep-env",
        "1",
        "--",
        "-rf",
        "*",
        "~",
        "$HOME",
        "a\\b",
        "",
        " spaced  out ",
        "ünïcødé ✓",
    ]


@pytest.fixture
def ct_place(proxmox: Proxmox) -> ContainerPlace:
    proxmox.create(CT)
    place = ContainerPlace(SSHTransport(proxmox.alias), CT)
    yield place
    place.close()


def test_host_place_over_ssh(ssh_home: SSHHome, tmp_path: Path) -> None:
    place = HostPlace(SSHTransport("testbox"))
    assert isinstance(place, Place)
    place.ensure_ready()
    assert place.run(["echo", "hi"]).stdout == b"hi\n"
    with pytest.raises(RemoteCommandFailed) as info:
        place.run(["sh", "-c", "echo broken >&2; exit 4"])
    failure = info.value
    assert (failure.exit_code, failure.place) == (4, "root@127.0.0.1:" + str(ssh_home.server.port))
    assert "broken" in str(failure) and "exit 4" in str(failure)
    assert place.run(["false"], check=False).exit_code == 1
    place.close()


def test_host_place_local() -> None:
    place = HostPlace(LocalTransport())
    assert place.description == "local"
    assert b"".join(place.stream(["echo", "x"])) == b"x\n"
    with pytest.raises(RemoteCommandFailed, match="on local"):
        place.run(["false"])


def test_hostile_argv_literal_over_ssh(ssh_home: SSHHome, tmp_path: Path) -> None:
    canary = str(tmp_path / "canary")
    words = hostile(canary)
    place = HostPlace(SSHTransport("testbox"))
    out = place.run(["printf", "%s\\0", *words]).stdout
    assert out.decode().split("\0")[:-1] == words
    assert not Path(canary).exists()
    place.close()


def test_container_run_env_and_hostname(ct_place: ContainerPlace, proxmox: Proxmox) -> None:
    ct_place.ensure_ready()
    assert ct_place.description == f"ct {CT} on root@127.0.0.1:{proxmox.ssh.server.pve_port}"
    assert ct_place.run(["hostname"]).stdout == f"ct{CT}\n".encode()
    # --keep-env 0: the host's (and the ssh session's) environment does not leak in.
    env = dict(
        line.split("=", 1) for line in ct_place.run(["env"]).stdout_text.splitlines() if line
    )
    assert env == {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                   "container": "lxc"}  # fmt: skip
    result = ct_place.run(["sh", "-c", "echo out; echo err >&2; exit 3"], check=False)
    assert (result.exit_code, result.stdout, result.stderr) == (3, b"out\n", b"err\n")
    assert result.argv == ("sh", "-c", "echo out; echo err >&2; exit 3")
    assert ct_place.run(["sh", "-c", "kill -9 $$"], check=False).exit_code == 137
    with pytest.raises(RemoteCommandFailed) as info:
        ct_place.run(["sh", "-c", "echo nope >&2; exit 9"])
    assert info.value.exit_code == 9 and info.value.place == ct_place.description


def test_container_stream(ct_place: ContainerPlace) -> None:
    stream = ct_place.stream(["sh", "-c", "echo a; sleep 0.2; echo b; exit 6"])
    assert next(stream) == b"a\n"
    assert b"".join(stream) == b"b\n"
    assert stream.exit_code == 6


def test_tar_on_stdin_lands_in_the_container_only(
    ct_place: ContainerPlace, proxmox: Proxmox
) -> None:
    folder = f"/root/dflash-{uuid.uuid4().hex[:8]}"
    files = {
        "trainer/model/drafter.py": b"print('hi')\n",
        "odd name $(x) 'q'.txt": b"\x00\xff" * 50_000,
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    buffer.seek(0)
    ct_place.run(["mkdir", "-p", folder])
    ct_place.run(["tar", "-x", "-C", folder], stdin=buffer)
    for name, data in files.items():
        assert ct_place.run(["cat", f"{folder}/{name}"]).stdout == data
        assert (proxmox.root_dir(CT) / folder.removeprefix("/root/") / name).read_bytes() == data
    assert not Path(folder).exists()  # the host's /root is not the container's


def test_containers_are_isolated_from_each_other(proxmox: Proxmox) -> None:
    proxmox.create(201)
    proxmox.create(202)
    transport = SSHTransport(proxmox.alias)
    first, second = ContainerPlace(transport, 201), ContainerPlace(transport, 202)
    first.run(["sh", "-c", "echo mine > /root/marker; echo w > /workspace/w"])
    assert second.run(["test", "-e", "/root/marker"], check=False).exit_code == 1
    assert second.run(["test", "-e", "/workspace/w"], check=False).exit_code == 1
    assert proxmox.exec_in(201, ["cat", "/root/marker"]).stdout == b"mine\n"
    assert transport.connections_opened == 1  # both containers through one connection
    transport.close()


def test_hostile_argv_literal_through_pct_exec(ct_place: ContainerPlace, proxmox: Proxmox) -> None:
    canary = "/workspace/canary"
    words = hostile(canary)
    out = ct_place.run(["printf", "%s\\0", *words]).stdout
    assert out.decode().split("\0")[:-1] == words
    assert not (proxmox.workspace_dir(CT) / "canary").exists()
    assert proxmox.exec_in(CT, ["test", "-e", canary]).returncode == 1


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    words=st.lists(
        st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00")),
        min_size=1,
        max_size=4,
    )
)
def test_any_text_passes_literally_through_pct_exec(
    ct_place: ContainerPlace, words: list[str]
) -> None:
    out = ct_place.run(["printf", "%s\\0", *words]).stdout
    assert out.decode().split("\0")[:-1] == words


def test_missing_container(proxmox: Proxmox) -> None:
    place = ContainerPlace(SSHTransport(proxmox.alias), 999)
    with pytest.raises(ContainerNotFound, match="999"):
        place.ensure_ready()
    with pytest.raises(ContainerNotFound):
        place.run(["true"], check=False)  # pct's failure, not the command's
    place.close()


def test_stopped_container(proxmox: Proxmox) -> None:
    proxmox.create(CT, running=False)
    place = ContainerPlace(SSHTransport(proxmox.alias), CT)
    with pytest.raises(ContainerStopped) as info:
        place.ensure_ready()
    assert f"pct start {CT}" in info.value.hint
    with pytest.raises(ContainerStopped):
        place.run(["true"], check=False)
    proxmox.start(CT)
    place.ensure_ready()
    assert place.run(["echo", "up"]).stdout == b"up\n"
    place.close()


def test_container_stopped_between_two_commands(ct_place: ContainerPlace, proxmox: Proxmox) -> None:
    ct_place.run(["sh", "-c", "echo 1 > /workspace/state"])
    proxmox.stop(CT)
    with pytest.raises(ContainerStopped):
        ct_place.run(["cat", "/workspace/state"])
    with pytest.raises(ContainerStopped):
        list(ct_place.stream(["cat", "/workspace/state"]))
    proxmox.start(CT)
    assert ct_place.run(["cat", "/workspace/state"]).stdout == b"1\n"  # its disk survived


def test_stop_ends_every_process_in_the_container(
    ct_place: ContainerPlace, proxmox: Proxmox
) -> None:
    ct_place.run(["sh", "-c", "setsid sleep 300 >/dev/null 2>&1 < /dev/null &"])
    assert proxmox.exec_in(CT, ["pgrep", "-x", "sleep"]).returncode == 0
    proxmox.stop(CT)
    proxmox.start(CT)
    assert proxmox.exec_in(CT, ["pgrep", "-x", "sleep"]).returncode == 1


def test_host_without_pct(proxmox: Proxmox) -> None:
    place = ContainerPlace(SSHTransport(proxmox.no_pct_alias), CT)
    with pytest.raises(PctMissing, match="not a Proxmox VE node"):
        place.ensure_ready()
    with pytest.raises(PctMissing):
        place.run(["true"])
    place.close()


def test_container_place_over_local_pct(proxmox: Proxmox, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same place works when this machine is the Proxmox node (pct on the local PATH)."""
    proxmox.create(CT)
    monkeypatch.setenv("DFLASH_PCT_STATE", str(proxmox.state))
    monkeypatch.setenv(
        "PATH", f"{Path(__file__).parents[1] / 'fixtures' / 'pct_standin'}:/usr/bin:/bin"
    )
    place = ContainerPlace(LocalTransport(), CT)
    place.ensure_ready()
    assert place.run(["hostname"]).stdout == f"ct{CT}\n".encode()
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    with pytest.raises(PctMissing):
        ContainerPlace(LocalTransport(), CT).ensure_ready()


@pytest.mark.parametrize("bad", ["200; rm -rf /", -1, True, "abc", 42])
def test_container_id_validated(bad: object) -> None:
    with pytest.raises(UnsafeValue, match="container id"):
        ContainerPlace(LocalTransport(), bad)  # type: ignore[arg-type]


def test_tmux_server_in_a_container_is_its_own(ct_place: ContainerPlace, proxmox: Proxmox) -> None:
    """A job's tmux lives in the container (private /tmp), not on the host, and dies with it."""
    socket_name = f"dflash-test-{uuid.uuid4().hex[:8]}"
    tmux = ["tmux", "-L", socket_name]
    ct_place.run([*tmux, "new-session", "-d", "-s", "job", "sleep 300"], timeout=10)
    assert ct_place.run([*tmux, "has-session", "-t", "job"], check=False).exit_code == 0
    assert LocalTransport().run([*tmux, "has-session", "-t", "job"]).exit_code != 0
    proxmox.stop(CT)
    proxmox.start(CT)
    assert ct_place.run([*tmux, "has-session", "-t", "job"], check=False).exit_code != 0
