"""What a place sends back is untrusted, and nothing waits forever on it. Real places (this
machine, the loopback sshd, a container of the `pct` stand-in); the hostile parts are the
`tests/fixtures/hostile_tool/hostile` script under a tool's name (tmux, pct, python3) in a
folder first on PATH there, or a job whose log is full of escape sequences:

- a tool that prints escape sequences, C1 controls and bytes that are not UTF-8, or 200 MiB,
  or that hangs: every command's output is valid UTF-8 without a control character (newline
  and tab aside), the command's memory stays under 200 MB, and it ends within its bound (the
  target's `timeout` is 3 s here), naming what did not answer;
- a log full of escape sequences: status, logs and logs --follow show them as `^[` and the
  like, `logs --raw` as they are;
- a deploy killed during its pre-checks (its python hangs): nothing of it is left running at
  the place once its watcher's bound has passed.

Rerun: .venv/bin/python -m pytest -q tests/system/test_untrusted_place.py
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash_ops.settings import project as projects
from tests.cli_helpers import REPO, Where, container_defaults, kill_tmux_server
from tests.fixtures.proxmox import Proxmox
from tests.fixtures.ssh import SSHHome, new_server, shutdown, write_client_home

HOSTILE = REPO / "tests" / "fixtures" / "hostile_tool" / "hostile"
TIMEOUT = 3  # [target] timeout: seconds one step may take at the place
MAX_RSS = 200 * 1024 * 1024  # bytes a command may hold, whatever the place prints
CT = 247
JOB = "echo up; exec sleep 600"
# C0 controls but newline and tab, DEL, C1 controls; and what reorders a line
_SHOWN_RAW = {*range(0x20), 0x7F, *range(0x80, 0xA0), 0x202E, 0x2066, 0x2028} - {0x09, 0x0A}


@dataclass
class Ran:
    code: int
    out: bytes
    err: bytes
    seconds: float
    max_rss: int  # bytes

    @property
    def text(self) -> str:
        return (self.out + self.err).decode("utf-8", "replace")


# `python -m dflash_ops ARGV[2:]` that writes its own peak memory (KiB, not its children's:
# a probe at the place may be a torch import here) to ARGV[1] when it exits.
_CLI = """
import atexit, resource, runpy, sys
peak, sys.argv = sys.argv[1], ["dflash", *sys.argv[2:]]
def said():
    with open(peak, "w") as out:
        out.write(str(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss))
atexit.register(said)
runpy.run_module("dflash_ops", run_name="__main__", alter_sys=True)
"""
# Forks that from a small process: a process's peak counts what it held before its exec, and a
# child of the test's own process would start with all of the test's memory.
_SMALL_FORK = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
sys.exit(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""


def run_measured(where: Where, *args: str, path: str, limit: float = 120) -> Ran:
    """`dflash ARGS` in the project with `path` first on PATH, and its own peak memory."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PATH=f"{path}:{os.environ['PATH']}")
    env.pop("DFLASH_CONFIG", None)
    peak = where.project.parent / f"rss-{uuid.uuid4().hex[:8]}"
    began = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-S", "-c", _SMALL_FORK, sys.executable, "-c", _CLI, str(peak), *args],
        cwd=where.project, env=env, stdin=subprocess.DEVNULL, capture_output=True,
        timeout=limit,
    )  # fmt: skip
    seconds = time.monotonic() - began
    return Ran(proc.returncode, proc.stdout, proc.stderr, seconds, int(peak.read_text()) * 1024)


def assert_clean(ran: Ran, what: str) -> None:
    """Valid UTF-8, no control character but newline and tab, nothing that reorders a line."""
    for name, data in (("stdout", ran.out), ("stderr", ran.err)):
        text = data.decode("utf-8")  # raises on bytes that are not UTF-8
        raw = sorted({f"U+{ord(c):04X}" for c in text if ord(c) in _SHOWN_RAW})
        assert not raw, f"{what}: {name} holds {raw}: {text[-600:]!r}"


def assert_bounded(ran: Ran, what: str, seconds: float) -> None:
    assert_clean(ran, what)
    assert ran.max_rss < MAX_RSS, f"{what}: {ran.max_rss / 2**20:.0f} MiB"
    assert ran.seconds < seconds, f"{what} took {ran.seconds:.1f} s: {ran.text[-600:]}"


@dataclass
class Fakes:
    """The folder of hostile tools, first on PATH at the place."""

    folder: Path

    def set(self, tool: str, mode: str | None, *, size: int | None = None) -> None:
        (self.folder / tool).unlink(missing_ok=True)
        (self.folder / tool).symlink_to(HOSTILE)
        (self.folder / f"{tool}.mode").write_text(mode or "")
        if size is not None:
            (self.folder / f"{tool}.bytes").write_text(str(size))

    def clear(self) -> None:
        for mode in self.folder.glob("*.mode"):
            mode.write_text("")

    def end_hung(self) -> None:
        """SIGKILL what a `hang` left running here (sshd lets a dropped command run on)."""
        for pid in hung(str(self.folder)):
            os.kill(pid, signal.SIGKILL)


def hung(folder: str = "") -> list[int]:
    """Pids of the hostile tools hanging now (of those in `folder`)."""
    return [
        pid
        for pid, args in processes()
        if args[0].endswith(b".hang") and args[0].startswith(folder.encode())
    ]


def processes() -> Iterator[tuple[int, list[bytes]]]:
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if args[0]:
            yield int(cmdline.parent.name), args


@pytest.fixture(scope="module")
def fakes_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fakes")


@pytest.fixture(scope="module")
def hostile_sshd(tmp_path_factory: pytest.TempPathFactory, fakes_dir: Path) -> Iterator[object]:
    """An sshd of its own whose sessions (both ports) have the fakes first on PATH."""
    server = new_server(tmp_path_factory.mktemp("sshd"), path_prefix=str(fakes_dir))
    yield server
    shutdown(server)


@pytest.fixture
def fakes(fakes_dir: Path) -> Iterator[Fakes]:
    made = Fakes(fakes_dir)
    made.clear()
    yield made
    made.clear()
    made.end_hung()


@pytest.fixture(params=["local", "ssh", "proxmox"])
def where(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Where]:
    project = tmp_path / "project"
    project.mkdir()
    sock = f"dft-{uuid.uuid4().hex[:10]}"
    line = f"timeout = {TIMEOUT}\n"
    if request.param == "local":
        place = Where("local", project, [], tmp_path / "root", tmp_path / "ckpt", sock)
        place.targets = f'[target]\nroot = "{place.root}"\ncheckpoints = "{place.checkpoints}"\n'
        place.targets += line
        yield place
        kill_tmux_server(sock)
        return
    server = request.getfixturevalue("hostile_sshd")
    home: SSHHome = write_client_home(server, tmp_path / "home")  # type: ignore[arg-type]
    monkeypatch.setenv("HOME", str(home.home))
    if request.param == "ssh":
        place = Where("ssh", project, [], tmp_path / "root", tmp_path / "ckpt", sock)
        place.targets = (
            f'[target]\nplace = "ssh"\nhost = "testbox"\nroot = "{place.root}"\n'
            f'checkpoints = "{place.checkpoints}"\n{line}'
        )
        yield place
        kill_tmux_server(sock)
        return
    node = Proxmox(state=server.pct_state, ssh=home)  # type: ignore[attr-defined]
    node.teardown()
    node.create(CT)
    place = Where("proxmox", project, [], *container_defaults(node, CT, project), sock)
    place.targets = f'[target]\nplace = "proxmox"\nhost = "pvehost"\nct = {CT}\n{line}'
    yield place
    node.teardown()


def deploy(where: Where, fakes: Fakes, command: str = JOB) -> None:
    where.config(command)
    ran = run_measured(where, "deploy", path=str(fakes.folder))
    assert ran.code == 0, ran.text


# The commands each hostile tool is put before, and what names the step that hung.
COMMANDS = {
    "status": ("status",),
    "doctor": ("doctor", "--no-gpu-smoke"),
    "stop": ("stop",),
    "restart": ("restart",),
    "deploy": ("deploy",),
}
HUNG = {
    "status": "`tmux list-panes` did not answer within 3 s",
    "doctor": "`tmux -V` did not answer within 3 s",
    # from the stop on the place bounds its own tmux calls: it ends, and the lock goes with it
    "stop": "Could not stop the job on",
    "restart": "`tmux list-panes` did not answer within 3 s; nothing was switched",
    "deploy": "step tmux did not finish within 3 s",
}
PCT_HUNG = {"status": "`pct status` did not answer within 3 s", "deploy": "step start-up"}


@pytest.mark.slow  # a deploy, then each command against the hostile tool
@pytest.mark.parametrize("mode", ["escape", "flood", "hang"])
def test_a_hostile_tmux_or_pct_leaves_every_command_clean_bounded_and_ending(
    where: Where, fakes: Fakes, mode: str
) -> None:
    deploy(where, fakes)
    tool = "pct" if where.kind == "proxmox" else "tmux"
    fakes.set(tool, mode)
    commands = ("status", "deploy") if tool == "pct" else tuple(COMMANDS)
    for name in commands:
        ran = run_measured(where, *COMMANDS[name], path=str(fakes.folder))
        what = f"{name} with a {mode} {tool} ({where.kind})"
        # a hung step: its bound (the stop's: the job's stop waits on top) and the start-up
        assert_bounded(ran, what, 45.0)
        assert ran.code != 0, f"{what}: {ran.text[-600:]}"
        assert "Traceback" not in ran.text and "internal error" not in ran.text, ran.text
        if mode == "hang":
            said = (PCT_HUNG if tool == "pct" else HUNG)[name]
            assert said in ran.text, f"{what}: {ran.text[-600:]}"
        if mode == "escape":
            assert "^[]0;PWNED" in ran.text or "\\x" in ran.text or "^[" in ran.text, ran.text
    fakes.clear()
    assert run_measured(where, "stop", path=str(fakes.folder)).code == 0


def test_a_log_full_of_escapes_is_shown_visible_unless_raw(where: Where, fakes: Fakes) -> None:
    """The job's own log: a line of 5 MB, then a window title, a screen clear, colours, a C1
    CSI and a byte that is not UTF-8: status, logs and logs --follow show them rendered, and
    read a bounded end of the log (saying how much lies before it)."""
    title = r"\033]0;JOB-TITLE\007\033[2J\033[31mred\033[0m \302\233 \377"
    command = f"head -c 5000000 /dev/zero | tr '\\0' x; printf '\\n{title}\\n'; echo done"
    deploy(where, fakes, command)
    path = str(fakes.folder)
    end = time.monotonic() + 30
    while b"done" not in run_measured(where, "logs", "-n", "1", path=path).out:
        assert time.monotonic() < end, "the job never wrote its log"
        time.sleep(0.3)
    status = run_measured(where, "status", "--lines", "3", path=path)
    assert_bounded(status, "status", 60.0)
    assert "^[]0;JOB-TITLE^G^[[2J^[[31mred^[[0m \\x9b \\xff" in status.text, status.text
    assert len(status.out) < 80_000 and "bytes more before these lines" in status.text
    assert json.loads(status_json(where, path))["log_cut"] > 0
    shown = run_measured(where, "logs", "--tail", "3", path=path)
    assert_bounded(shown, "logs", 60.0)
    assert "^[[31mred" in shown.text and "bytes more of the log before these lines" in shown.text
    assert len(shown.out) <= 1024 * 1024 + 1000
    raw = run_measured(where, "logs", "--raw", "--tail", "3", path=path)
    assert b"\x1b]0;JOB-TITLE\x07" in raw.out and b"\xc2\x9b \xff" in raw.out
    follow = run_measured(where, "logs", "--follow", "--tail", "3", path=path)
    assert_bounded(follow, "logs --follow", 60.0)
    assert follow.code == 0 and "^[[31mred" in follow.text and follow.out.endswith(b"done\n")


@pytest.mark.parametrize("where", ["local"], indirect=True)
def test_stop_says_when_tmux_never_told_the_exit_status(where: Where, fakes: Fakes) -> None:
    """tmux shows the stopped job's pane dead without its status (as tmux 3.3 does when it
    misses a SIGCHLD): the stop says so, never `exit None`."""
    deploy(where, fakes)
    fakes.set("tmux", "quirks")
    (fakes.folder / "tmux.quirks").write_text("no-status")
    ran = run_measured(where, "stop", path=str(fakes.folder))
    assert ran.code == 0 and "None" not in ran.text, ran.text
    assert "was stopped and its session closed (tmux had not recorded its exit status" in ran.text


def status_json(where: Where, path: str) -> str:
    ran = run_measured(where, "status", "--json", path=path)
    assert ran.code == 0, ran.text
    assert_clean(ran, "status --json")
    return ran.out.decode()


def deploy_scripts(root: Path) -> list[int]:
    """Pids of site programs (`dflash-deploy`) still running for `root`."""
    return [
        pid for pid, args in processes() if b"dflash-deploy" in args and str(root).encode() in args
    ]


def test_a_deploy_killed_in_its_prechecks_leaves_nothing_running(
    where: Where, fakes: Fakes
) -> None:
    """The job's python hangs in deploy's preflight (before the lock); dflash is SIGKILLed
    there. Its program at the place sees its caller gone from the first byte and ends, the hung
    probe with it (SIGKILL after 3 s: it ignores SIGTERM)."""
    python = fakes.folder / "python3"
    if where.kind == "proxmox":
        # the container's /root, as this machine sees it: above the project's default root
        below = Path(projects.load(where.project).remote_root).relative_to("/root")
        node_root = where.root.parents[len(below.parts) - 1]
        shutil.copy(HOSTILE, node_root / "python3")
        (node_root / "python3.mode").write_text("hang")
        where.targets += 'python = "/root/python3"\n'
    else:
        fakes.set("python3", "hang")
        where.targets += f'python = "{python}"\n'
    where.config(JOB)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cli = subprocess.Popen(
        [sys.executable, "-m", "dflash_ops", "deploy"], cwd=where.project, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    end = time.monotonic() + 60
    while not hung():  # the probe hangs
        assert cli.poll() is None and time.monotonic() < end, "the probe never ran"
        time.sleep(0.05)
    own = projects.load(where.project).remote_root  # the root as the container says it
    root = Path(own) if where.kind == "proxmox" else where.root
    assert deploy_scripts(root)
    cli.send_signal(signal.SIGKILL)
    cli.wait()
    killed = time.monotonic()
    while deploy_scripts(root) or hung():
        assert time.monotonic() - killed < 10, (deploy_scripts(root), hung())
        time.sleep(0.1)
    assert not (where.root / "deploy.lock").is_symlink()  # it never got that far
