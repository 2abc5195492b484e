"""The place can run the job: every deploy and `dflash doctor` ask the job's python, in ONE
`python -c`, for every module the trainer imports (read from the trainer's sources) and refuse
with the missing ones named, before anything stops; the fix works under PEP 668 (a venv, never
`pip install` into the system python). `[venv]` builds that venv at the place, offline from a
wheel folder, once per requirements, and the job runs its python.

The place is a container of the `pct` stand-in, whose `python3` is this machine's Debian system
python: externally managed (PEP 668), with its `venv` module, without numpy or torch."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
import zipfile
from pathlib import Path

import pytest

from tests.cli_helpers import dflash, wait_for

CT = 270
JOB = 'echo "python=$DFLASH_PYTHON"; "$DFLASH_PYTHON" -c "import tinyword; print(tinyword.WORD)"; exec sleep 60'


def project_at(tmp_path: Path, proxmox, *, venv: str = "", imports: str = "") -> Path:  # type: ignore[no-untyped-def]
    """A project whose trainer/ imports `imports` (a module of its own otherwise), deploying
    to container CT with the container's `python3`."""
    project = tmp_path / "project"
    (project / "trainer").mkdir(parents=True, exist_ok=True)
    (project / "trainer" / "job.py").write_text(f"import json\n{imports}\n")
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    (project / "deploy.toml").write_text(
        f'[target]\nplace = "proxmox"\nhost = "{proxmox.alias}"\nct = {CT}\n\n'
        f"[job]\nsocket = {json.dumps(socket)}\ncommand = {json.dumps(JOB)}\nstop_timeout = 3\n"
        f"{venv}\n[train]\ndemo = true\n"
    )
    return project


def test_a_place_without_numpy_is_refused_before_anything_stops(tmp_path: Path, proxmox) -> None:  # type: ignore[no-untyped-def]
    proxmox.create(CT)
    project = project_at(tmp_path, proxmox)
    first = dflash(project, "deploy")  # the trainer imports nothing the place lacks
    assert first.returncode == 0, first.stderr
    log = proxmox.workspace_dir(CT) / "checkpoints" / "train_stdout.log"
    wait_for(log, "python=python3")
    before = json.loads(dflash(project, "status", "--json").stdout)

    (project / "trainer" / "job.py").write_text("import json\nimport numpy as np\n")
    refused = dflash(project, "deploy")
    assert refused.returncode == 1, refused.stderr
    err = refused.stderr
    assert "error: imports: python3 lacks numpy, which the trainer imports" in err, err
    assert "[venv]" in err and "dflash setup" in err and "PEP 668" in err
    assert "pip install numpy" not in err and "Traceback" not in err
    after = json.loads(dflash(project, "status", "--json").stdout)
    assert after["running"] and after["started_at"] == before["started_at"]
    assert after["release"] == before["release"]  # nothing stopped, nothing switched

    doctor = dflash(project, "doctor", "--json", "--no-gpu-smoke", "--min-free-gib", "0")
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["python"]["ok"] and not checks["imports"]["ok"]
    assert "lacks numpy" in checks["imports"]["detail"] and "[venv]" in checks["imports"]["fix"]
    assert dflash(project, "stop").returncode == 0
