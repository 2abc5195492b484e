"""The tmux job on the local place, started and stopped by the site program (restart, stop)
through its client: real tmux on a private socket per test, real files."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from dflash_ops.connect.place import HostPlace
from dflash_ops.connect.transport import LocalTransport
from dflash_ops.errors import UnsafeValue
from dflash_ops.remote.job import Job, JobState, LogTail, tmux_arg
from tests.site_helpers import Site, site_fixture, start, tmux_socket_fixture  # noqa: F401


@pytest.fixture
def job(site: Site) -> Job:
    return site.job


def wait_for(predicate, timeout: float = 10.0):  # type: ignore[no-untyped-def]
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError("condition not met in time")


def exited(job: Job) -> JobState:
    return wait_for(lambda: (s := job.state()).exists and not s.running and s)


def test_start_runs_argv_with_env_cwd_and_appends_log(site: Site, job: Job, tmp_path: Path) -> None:
    log = Path(job.log)
    log.parent.mkdir(parents=True)
    log.write_text("earlier run\n")
    argv = ["bash", "-c", 'echo "out $MY_VAR"; pwd; echo err >&2; exit 3']
    start(site, argv, cwd=str(tmp_path), env={"MY_VAR": "hello world"})
    state = exited(job)
    assert state.exit_code == 3
    assert log.read_text() == f"earlier run\nout hello world\n{tmp_path}\nerr\n"
    assert state.started_at is not None and abs(state.started_at - time.time()) < 60


def test_state_without_session(job: Job) -> None:
    state = job.state()
    assert not state.exists and not state.running and state.exit_code is None


def test_running_job_is_stopped_by_sigint(site: Site, job: Job, tmp_path: Path) -> None:
    start(site, ["sleep", "60"], cwd=str(tmp_path), env={})
    state = wait_for(lambda: (s := job.state()).running and s)
    assert state.pid is not None
    final = site.stop().stopped
    assert final is not None and not final.running
    assert final.exit_code == 128 + 2  # SIGINT ended it
    assert not job.state().exists
    with pytest.raises(ProcessLookupError):
        os.kill(state.pid, 0)


def test_stop_escalates_when_sigint_is_ignored(site: Site, job: Job, tmp_path: Path) -> None:
    marker = tmp_path / "trapped"
    script = f"trap 'touch {marker}' INT; while true; do sleep 0.1; done"
    start(site, ["bash", "-c", script], cwd=str(tmp_path), env={})
    state = wait_for(lambda: (s := job.state()).running and s)
    time.sleep(0.3)  # let bash install its trap
    job.stop_timeout = 0.5
    final = site.stop().stopped
    assert marker.exists()  # SIGINT arrived and was ignored, then SIGTERM ended the group
    assert final is not None and final.exit_code == 128 + 15
    with pytest.raises(ProcessLookupError):
        os.kill(state.pid, 0)  # type: ignore[arg-type]


def test_stop_without_session_is_none(site: Site) -> None:
    assert site.stop().stopped is None


def test_tail_and_follow_return_exit_code(site: Site, job: Job, tmp_path: Path) -> None:
    script = "for i in 1 2 3 4 5; do echo line $i; sleep 0.1; done; exit 7"
    start(site, ["bash", "-c", script], cwd=str(tmp_path), env={})
    seen: list[bytes] = []
    state = job.follow(seen.append, offset=0)
    assert state.exit_code == 7
    assert b"".join(seen) == b"".join(f"line {i}\n".encode() for i in range(1, 6))
    tail = job.tail(2)
    assert tail.body == b"line 4\nline 5\n" and tail.cut == 0
    assert tail.size == Path(job.log).stat().st_size
    cut = job.tail(2, cap=10)  # the last 10 bytes: one line and the end of the one before
    assert cut == LogTail(body=b" 4\nline 5\n", size=tail.size, cut=tail.size - 10)


def test_follow_prints_each_line_as_it_comes(site: Site, job: Job, tmp_path: Path) -> None:
    """A line appears to the follower while the job is still running (not only at the end)."""
    gate = tmp_path / "gate"
    script = f"echo first; while [ ! -e {gate} ]; do sleep 0.05; done; echo second"
    start(site, ["bash", "-c", script], cwd=str(tmp_path), env={})
    seen: list[bytes] = []
    result: list[JobState] = []
    thread = threading.Thread(target=lambda: result.append(job.follow(seen.append, offset=0)))
    thread.start()
    wait_for(lambda: b"first\n" in b"".join(seen))
    assert job.state().running
    gate.touch()
    thread.join(10)
    assert b"".join(seen) == b"first\nsecond\n"
    assert result[0].exit_code == 0


def test_follow_resumes_from_offset(site: Site, job: Job, tmp_path: Path) -> None:
    start(site, ["bash", "-c", "echo abc; echo def"], cwd=str(tmp_path), env={})
    exited(job)
    seen: list[bytes] = []
    job.follow(seen.append, offset=4)
    assert b"".join(seen) == b"def\n"


def test_tail_without_log(job: Job) -> None:
    assert job.tail(10) == LogTail(body=b"", size=-1)


@pytest.mark.parametrize(
    "value",
    [
        "$(touch CANARY)",
        "`touch CANARY`",
        "a; touch CANARY",
        "x;",
        "run-shell 'touch CANARY' ;",
        "#(touch CANARY)",
        "line\nbreak; touch CANARY",
        "'\"; touch CANARY; echo \"'",
    ],
)
def test_hostile_env_values_and_argv_pass_literally(
    site: Site, job: Job, tmp_path: Path, value: str
) -> None:
    value = value.replace("CANARY", str(tmp_path / "canary"))
    start(
        site,
        ["bash", "-c", 'printf "%s|%s" "$V" "$1"', "arg0", value],
        cwd=str(tmp_path),
        env={"V": value},
    )
    assert exited(job).exit_code == 0
    assert Path(job.log).read_text() == f"{value}|{value}"
    assert not (tmp_path / "canary").exists()


def test_hostile_cwd_is_literal(site: Site, job: Job, tmp_path: Path) -> None:
    odd = tmp_path / "#(touch canary) $(x) ;"
    odd.mkdir()
    start(site, ["pwd"], cwd=str(odd), env={})
    assert exited(job).exit_code == 0
    assert Path(job.log).read_text() == f"{odd}\n"
    assert not (tmp_path / "canary").exists()


@pytest.mark.parametrize("name", ["a;b", "$(x)", "-t", "a b", "", "a:b", "x" * 65])
def test_hostile_session_names_are_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(UnsafeValue):
        Job(HostPlace(LocalTransport()), session=name, log=str(tmp_path / "log"))


def test_hostile_env_key_is_refused(site: Site, job: Job, tmp_path: Path) -> None:
    with pytest.raises(UnsafeValue):
        start(site, ["true"], cwd=str(tmp_path), env={"A;touch x": "1"})
    assert not job.state().exists


def test_tmux_arg_escapes_trailing_semicolon() -> None:
    assert tmux_arg("a;") == "a\\;"
    assert tmux_arg("a\\;") == "a\\\\;"
    assert tmux_arg("a;b") == "a;b"
