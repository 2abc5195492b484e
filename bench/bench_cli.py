"""The CLI over loopback: `dflash deploy` wall time and SSH connections, `logs --follow` latency.

    python bench/bench_cli.py --out cli.json [--reps 3] [--lines 20]

Starts the test fixtures' real parts (tests/fixtures: an sshd on 127.0.0.1 whose `pvehost` port
has the namespace-backed `pct` stand-in, one container) and, for each place — this machine,
the SSH host `testbox`, container 200 on `pvehost` — measures:

- deploy, as a user runs it: the wall time of `python -m dflash_ops deploy` until it returns
  (`--no-wait`, and the job is `exec sleep 3600`, which starts instantly: job start-up is
  excluded), and the SSH connections and remote commands the server logged for it
  (`Accepted publickey`, `Starting session`);
- deploy, in this process: the same `operations.deploy`, with the bundle build, every remote
  round trip and `connections_opened` of the transport counted (no interpreter start-up);
- follow latency: `dflash logs --follow` runs; lines carrying `time.time()` are appended to the
  job's log at the place, one every 0.1 s; latency = when the line came out of the follower's
  stdout minus the time in it. Median and p95.

Over SSH every command runs in root's login shell, which reads root's `~/.bashrc` (sshd uses the
passwd home); `shell_start_s` measures what one `ssh … true` costs at the server so the
figures can be read with it in mind.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from dflash_ops.commands import operations  # noqa: E402
from dflash_ops.commands.workspace import Workspace, open_place  # noqa: E402
from dflash_ops.connect.place import what_runs  # noqa: E402
from dflash_ops.connect.stdin import Stdin  # noqa: E402
from dflash_ops.connect.transport import STDOUT_CAP, Result, StreamResult, Watch  # noqa: E402
from dflash_ops.settings.deploy_config import TargetFlags  # noqa: E402
from tests.cli_helpers import Where, kill_tmux_server  # noqa: E402
from tests.fixtures.proxmox import Proxmox  # noqa: E402
from tests.fixtures.ssh import SSHServer, new_server, shutdown, write_client_home  # noqa: E402

CT = 200
JOB = "exec sleep 3600"  # starts at once: deploy's time is the CLI's own


class CountingPlace:
    """A place that forwards to another and records every round trip (label, seconds)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.description = inner.description
        self.transport = inner.transport
        self.timeout = inner.timeout
        self.trips: list[tuple[str, float]] = []

    def run(
        self,
        argv: Sequence[str],
        *,
        stdin: Stdin = None,
        timeout: float | None = None,
        check: bool = True,
        cap: int = STDOUT_CAP,
        watch: Watch | None = None,
    ) -> Result:
        start = time.perf_counter()
        try:
            return self.inner.run(
                argv, stdin=stdin, timeout=timeout, check=check, cap=cap, watch=watch
            )
        finally:
            self.trips.append((what_runs(argv), time.perf_counter() - start))

    def stream(self, argv: Sequence[str]) -> StreamResult:
        self.trips.append((what_runs(argv), 0.0))
        return self.inner.stream(argv)

    def ensure_ready(self) -> None:
        start = time.perf_counter()
        self.inner.ensure_ready()
        self.trips.append(("ensure_ready", time.perf_counter() - start))

    def close(self) -> None:
        self.inner.close()


def sshd_counts(server: SSHServer) -> tuple[int, int]:
    """(connections accepted, sessions started) in the server's log so far."""
    text = server.log_path.read_text(errors="replace")
    return text.count("Accepted publickey"), len(re.findall(r"Starting session: command", text))


def shell_start_s(reps: int = 5) -> float:
    """What starting root's shell costs per command: sshd runs `bash -c COMMAND`, and bash
    started by sshd (SSH_CLIENT set) reads ~/.bashrc. Median of that minus `bash --norc`."""

    def median_of(argv: list[str], env: dict[str, str]) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            subprocess.run(argv, env=env, check=True)
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    path = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    as_sshd = {**path, "HOME": "/root", "SSH_CLIENT": "127.0.0.1 40000 22", "SHLVL": "0"}
    return median_of(["bash", "-c", "true"], as_sshd) - median_of(
        ["bash", "--norc", "-c", "true"], path
    )


def make_places(tmp: Path, proxmox: Proxmox) -> list[Where]:
    places = []
    for kind in ("local", "ssh", "proxmox"):
        project = tmp / kind / "project"
        project.mkdir(parents=True)
        shutil.copytree(
            REPO / "trainer",
            project / "trainer",
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
        )
        socket = f"dfb-{uuid.uuid4().hex[:10]}"
        if kind == "local":
            root = project / ".dflash" / "local"
            spot = Where(kind, project, [], root, root / "checkpoints", socket)
        elif kind == "ssh":
            root, ckpt = tmp / kind / "remote-root", tmp / kind / "remote-ckpt"
            spot = Where(kind, project, ["--target", "box"], root, ckpt, socket)
            spot.targets = (
                f'[targets.box]\nplace = "ssh"\nhost = "testbox"\n'
                f'root = "{root}"\ncheckpoints = "{ckpt}"\n'
            )
        else:
            proxmox.create(CT)
            root = proxmox.root_dir(CT) / "dflash"
            spot = Where(
                kind,
                project,
                ["--host", proxmox.alias, "--ct", str(CT)],
                root,
                proxmox.workspace_dir(CT) / "checkpoints",
                socket,
            )
        spot.config(JOB)
        places.append(spot)
    return places


def bench_cli_deploy(where: Where, server: SSHServer, reps: int) -> dict[str, Any]:
    walls, conns, sessions = [], [], []
    for _ in range(reps):
        before = sshd_counts(server)
        start = time.perf_counter()
        result = where.run("deploy", "--no-wait", *where.flags)
        walls.append(time.perf_counter() - start)
        if result.returncode != 0:
            raise RuntimeError(f"deploy to {where.kind} failed: {result.stderr}")
        after = sshd_counts(server)
        conns.append(after[0] - before[0])
        sessions.append(after[1] - before[1])
    return {
        "wall_s": walls,
        "wall_median_s": statistics.median(walls),
        "sshd_connections": conns,
        "sshd_sessions": sessions,
    }


def bench_inprocess_deploy(where: Where, reps: int) -> dict[str, Any]:
    runs = []
    cwd = os.getcwd()
    os.chdir(where.project)
    try:
        for _ in range(reps):
            start = time.perf_counter()
            ws = Workspace.load(config_file=None, flags=TargetFlags())
            place = CountingPlace(open_place(ws.target))
            place.transport.connect()  # as `operations.deploy` opens it (no `pct status`)
            ws._place = place
            try:
                operations.deploy(ws, wait=False)
            finally:
                ws.close()
            total = time.perf_counter() - start
            runs.append(
                {
                    "total_s": total,
                    "remote_s": sum(s for _, s in place.trips),
                    "round_trips": len(place.trips),
                    "connections_opened": place.transport.connections_opened,
                    "trips": [[label, round(s, 4)] for label, s in place.trips],
                }
            )
    finally:
        os.chdir(cwd)
    best = min(runs, key=lambda r: r["total_s"])
    return {
        "total_median_s": statistics.median(r["total_s"] for r in runs),
        "remote_median_s": statistics.median(r["remote_s"] for r in runs),
        "round_trips": best["round_trips"],
        "connections_opened": max(r["connections_opened"] for r in runs),
        "trips_of_fastest": best["trips"],
    }


def _reader(proc: subprocess.Popen[bytes], out: queue.Queue[tuple[bytes, float]]) -> None:
    """Put each line of the follower's stdout on `out` with the time it arrived."""
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buffer = b""
    while chunk := os.read(fd, 65536):
        now = time.time()
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            out.put((line, now))


def _wait_for(
    lines: queue.Queue[tuple[bytes, float]], wanted: bytes, timeout: float
) -> float | None:
    """When the line starting with `wanted` arrived, or None after `timeout` s."""
    end = time.monotonic() + timeout
    while (left := end - time.monotonic()) > 0:
        try:
            line, arrived = lines.get(timeout=left)
        except queue.Empty:
            return None
        if line.startswith(wanted):
            return arrived
    return None


def bench_follow(where: Where, count: int) -> dict[str, Any]:
    """Lines carrying their write time go into the job's log (as this machine sees the place's
    file); latency = arrival at the follower's stdout minus that time."""
    log = where.checkpoints / "train_stdout.log"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_ops", "logs", "--follow", "--tail", "0"],
        cwd=where.project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    lines: queue.Queue[tuple[bytes, float]] = queue.Queue()
    threading.Thread(target=_reader, args=(proc, lines), daemon=True).start()
    latencies: list[float] = []
    tag = uuid.uuid4().hex[:8]
    try:
        for attempt in range(30):  # until the follower streams: it prints a probe line
            with log.open("a") as f:
                f.write(f"probe {tag} {attempt}\n")
            if _wait_for(lines, f"probe {tag}".encode(), 1.0) is not None:
                break
        else:
            raise RuntimeError(f"logs --follow on {where.kind} printed nothing")
        for i in range(count):
            time.sleep(0.1)
            line = f"bench {tag} {i} "
            with log.open("a") as f:
                f.write(f"{line}{time.time():.6f}\n")
                f.flush()
                written = time.time()
            arrived = _wait_for(lines, line.encode(), 5.0)
            if arrived is not None:
                latencies.append(arrived - written)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    if not latencies:
        raise RuntimeError(f"logs --follow on {where.kind} printed none of the timed lines")
    latencies.sort()
    p95 = latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))]
    return {
        "lines": len(latencies),
        "median_s": statistics.median(latencies),
        "p95_s": p95,
        "max_s": latencies[-1],
    }


def main() -> None:
    head, _, rest = __doc__.partition("\n\n")
    parser = argparse.ArgumentParser(
        description=head, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, required=True, help="write the results as JSON here")
    parser.add_argument("--reps", type=int, default=3, help="CLI deploys per place (median)")
    parser.add_argument("--lines", type=int, default=20, help="lines followed per place")
    args = parser.parse_args()

    os.environ.pop("SSH_AUTH_SOCK", None)
    os.environ.pop("DFLASH_CONFIG", None)
    tmp = Path(tempfile.mkdtemp(prefix="dflash-bench-"))
    server = new_server(tmp / "sshd")
    client = write_client_home(server, tmp / "home")
    os.environ["HOME"] = str(client.home)
    proxmox = Proxmox(state=server.pct_state, ssh=client)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "shell_start_s": shell_start_s(),
        "places": {},
    }
    places: list[Where] = []
    try:
        places = make_places(tmp, proxmox)
        for where in places:
            row: dict[str, Any] = {"cli": bench_cli_deploy(where, server, args.reps)}
            row["inprocess"] = bench_inprocess_deploy(where, args.reps)
            row["follow"] = bench_follow(where, args.lines)
            results["places"][where.kind] = row
    finally:
        for where in places:
            if where.kind != "proxmox":
                kill_tmux_server(where.socket)
        proxmox.teardown()
        shutdown(server)
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))


def table(results: dict[str, Any]) -> str:
    rows = [
        f"{results['date']}; {results['machine']}; login shell start at the server "
        f"{results['shell_start_s']:.2f} s per command\n",
        "| place | deploy (CLI) | sshd conns | remote cmds | deploy in-process | round trips "
        "| remote time | conns opened | follow median | follow p95 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for kind, row in results["places"].items():
        cli, inproc, follow = row["cli"], row["inprocess"], row["follow"]
        rows.append(
            f"| {kind} | {cli['wall_median_s']:.2f} s | {max(cli['sshd_connections'])} "
            f"| {max(cli['sshd_sessions'])} | {inproc['total_median_s']:.2f} s "
            f"| {inproc['round_trips']} | {inproc['remote_median_s']:.2f} s "
            f"| {inproc['connections_opened']} | {follow['median_s'] * 1e3:.0f} ms "
            f"| {follow['p95_s'] * 1e3:.0f} ms |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
