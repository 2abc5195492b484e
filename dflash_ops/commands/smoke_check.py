"""The GPU smoke test at a place: ship `trainer/` to a scratch folder, run `trainer.commands.smoke`.

`trainer/` travels as one small tar on stdin into `<root>/doctor/<random>` (through `pct exec`
for a container, as a release does: no path on the Proxmox host is assumed), runs there as
`python -m trainer smoke --json` with the job's environment, and is removed again.
"""

from __future__ import annotations

import io
import json
import secrets
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dflash_ops.commands.checks import Check, Findings, Setup, failed, job_argv, passed
from dflash_ops.connect import shell
from dflash_ops.connect.place import Place
from dflash_ops.connect.transport import Result
from dflash_ops.remote.launch import verb
from dflash_ops.untrusted import last_line

SMOKE_TIMEOUT = 300.0


_SMOKE_UNPACK = 'set -e\nmkdir -p -- "$1"\nexec tar -x --no-same-owner -C "$1" -f -\n'
_IN_FOLDER = 'cd -- "$1" || exit 126\nshift\nexec "$@"\n'


def trainer_tar(trainer: Path, files: Mapping[str, bytes] | None = None) -> bytes:
    """`trainer/`'s Python files as a tar (caches and bytecode left out), and `files` (name →
    content) beside it."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in (files or {}).items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for path in sorted(trainer.rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            info = tar.gettarinfo(str(path), arcname=f"trainer/{path.relative_to(trainer)}")
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with path.open("rb") as handle:
                tar.addfile(info, handle)
    return buffer.getvalue()


def check_smoke(setup: Setup, place: Place, _: Findings) -> Check:
    """Ship trainer/ into `<root>/doctor/<id>` and run `python -m trainer smoke --json` there."""
    name = "gpu smoke test"
    trainer = (setup.project_dir or Path.cwd()) / "trainer"
    if not (trainer / "commands" / "smoke.py").is_file():
        return failed(
            name,
            f"no trainer to test: {trainer / 'commands' / 'smoke.py'} does not exist",
            "Run dflash doctor in the project folder (next to deploy.toml and trainer/).",
        )
    scratch = shell.remote_path(f"{setup.target.root}/doctor/{secrets.token_hex(4)}")
    argv = job_argv(setup, [setup.target.python, *verb("smoke", "--json", config=False)])
    result = run_in_scratch(
        place, scratch, trainer_tar(trainer), argv, timeout=max(SMOKE_TIMEOUT, place.timeout)
    )
    lines = result.stdout_text.strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (ValueError, IndexError):
        return failed(
            name,
            f"the smoke test crashed (exit {result.exit_code}): {last_line(result.stderr_text)}",
            "Run it by hand at the place for the full output: python -m trainer smoke",
        )
    return smoke_check(report, gpus=setup.job.gpus)


def run_in_scratch(
    place: Place, scratch: str, tar: bytes, argv: Sequence[str], *, timeout: float
) -> Result:
    """Unpack `tar` into `scratch` at the place, run `argv` there, remove `scratch` again."""
    try:
        place.run(["bash", "-c", _SMOKE_UNPACK, "dflash-doctor", scratch], stdin=tar)
        return place.run(
            ["bash", "-c", _IN_FOLDER, "dflash-doctor", scratch, *argv],
            check=False,
            timeout=timeout,
        )
    finally:
        place.run(["rm", "-rf", "--", scratch], check=False)


def smoke_check(report: Mapping[str, Any], *, gpus: int) -> Check:
    """Turn the smoke test's report into a check line; no CUDA fails only when GPUs are wanted."""
    name = "gpu smoke test"
    parts = [f"{report.get('path', '?')} on {report.get('device', '?')}"]
    errors = report.get("rel_errors")
    if errors:
        parts.append("rel. errors " + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()))
    if report.get("first_step_s") is not None:
        parts.append(f"first step {report['first_step_s']} s, then {report['step_s']} s")
    if report.get("peak_mib") is not None:
        parts.append(f"peak {report['peak_mib']} MiB")
    detail = "; ".join(parts)
    if not report.get("ok"):
        return failed(
            name,
            f"{report.get('error', 'failed')} ({detail})",
            "Run python -m trainer smoke at the place for details; a compile error usually "
            "means a torch/Triton mismatch: reinstall torch for that GPU's CUDA.",
        )
    if not report.get("cuda") and gpus > 0:
        return failed(
            name,
            f"no CUDA: only the CPU path ran ({detail}), but [job] gpus = {gpus}",
            "Fix the cuda check above first; then run dflash doctor again.",
        )
    return passed(name, detail)
