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

from tests.cli_helpers import dflash, wait_for

CT = 270
ROOT, CKPT = "dflash-env", "ck-env"  # in the container: /root/…, /workspace/…
JOB = 'echo "python=$DFLASH_PYTHON"; "$DFLASH_PYTHON" -c "import tinyword; print(tinyword.WORD)"; exec sleep 60'


def project_at(tmp_path: Path, proxmox, *, venv: str = "", imports: str = "") -> Path:  # type: ignore[no-untyped-def]
    """A project whose trainer/ imports `imports` (a module of its own otherwise), deploying
    to container CT with the container's `python3`."""
    project = tmp_path / "project"
    (project / "trainer").mkdir(parents=True, exist_ok=True)
    (project / "trainer" / "job.py").write_text(f"import json\n{imports}\n")
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    (project / "deploy.toml").write_text(
        f'[target]\nplace = "proxmox"\nhost = "{proxmox.alias}"\nct = {CT}\n'
        f'root = "/root/{ROOT}"\ncheckpoints = "/workspace/{CKPT}"\n\n'
        f"[job]\nsocket = {json.dumps(socket)}\ncommand = {json.dumps(JOB)}\nstop_timeout = 3\n"
        f"{venv}\n[train]\ndemo = true\n"
    )
    return project


def test_a_place_without_numpy_is_refused_before_anything_stops(tmp_path: Path, proxmox) -> None:  # type: ignore[no-untyped-def]
    proxmox.create(CT)
    project = project_at(tmp_path, proxmox)
    first = dflash(project, "deploy")  # the trainer imports nothing the place lacks
    assert first.returncode == 0, first.stderr
    log = proxmox.workspace_dir(CT) / CKPT / "train_stdout.log"
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


def wheel(folder: Path, name: str, version: str, body: str) -> Path:
    """A pure-Python wheel of one module `name`, made here: the place installs it offline."""
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": body.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).decode().rstrip('=')},{len(data)}"
        for path, data in files.items()
    ]
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name_in, data in files.items():
            archive.writestr(name_in, data)
        archive.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]) + "\n")
    return path


def test_the_venv_is_built_offline_from_a_wheel_folder_once_per_requirements(  # type: ignore[no-untyped-def]
    tmp_path: Path, proxmox
) -> None:
    """The project's trainer requires `tinyword` (its own requirements file: the real trainer's
    torch and transformers are the same pip install, only bigger). The container has no
    network for it: [venv] wheels is a folder there."""
    proxmox.create(CT)
    wheels = proxmox.root_dir(CT) / "wheels"
    wheels.mkdir()
    wheel(wheels, "tinyword", "1.0", 'WORD = "from the wheel"\n')
    venv = '\n[venv]\nwheels = "/root/wheels"\n'
    project = project_at(tmp_path, proxmox, venv=venv, imports="import tinyword")
    (project / "trainer" / "requirements.txt").write_text("tinyword==1.0\n")

    deployed = dflash(project, "deploy", timeout=600)  # no venv yet: the deploy builds it
    assert deployed.returncode == 0, deployed.stderr
    assert "Building the job's environment" in deployed.stderr
    assert "installing" in deployed.stderr and "built /root/dflash-env/venvs/" in deployed.stderr
    (folder,) = (proxmox.root_dir(CT) / ROOT / "venvs").glob("*[!k]")  # not the .lock
    assert (folder / ".complete").is_file()
    python = f"/root/{ROOT}/venvs/{folder.name}/bin/python"
    log = wait_for(proxmox.workspace_dir(CT) / CKPT / "train_stdout.log", "from the wheel")
    assert log.startswith(f"python={python}\n")

    again = dflash(project, "setup")  # built once: nothing installed again
    assert again.returncode == 0 and "ready (built before)" in again.stderr, again.stderr
    assert "installing" not in again.stderr
    redeployed = dflash(project, "deploy")
    assert redeployed.returncode == 0 and "Building" not in redeployed.stderr
    doctor = dflash(project, "doctor", "--json", "--no-gpu-smoke", "--min-free-gib", "0")
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["imports"]["ok"] and checks["imports"]["detail"] == f"{python} has tinyword"

    # New requirements, a new venv beside the old one (the running job keeps its own).
    wheel(wheels, "tinyword", "2.0", 'WORD = "two"\n')
    (project / "trainer" / "requirements.txt").write_text("tinyword==2.0\n")
    built = dflash(project, "setup", timeout=600)
    assert built.returncode == 0 and "is built." in built.stderr, built.stderr
    assert len([p for p in (proxmox.root_dir(CT) / ROOT / "venvs").iterdir() if p.is_dir()]) == 2
    assert dflash(project, "stop").returncode == 0


def test_a_venv_that_cannot_be_installed_names_pip_and_the_offline_fix(
    tmp_path: Path, proxmox
) -> None:  # type: ignore[no-untyped-def]
    proxmox.create(CT)
    (proxmox.root_dir(CT) / "wheels").mkdir()  # empty: the requirement cannot be found
    venv = '\n[venv]\nwheels = "/root/wheels"\nsystem_site_packages = true\n'
    project = project_at(tmp_path, proxmox, venv=venv, imports="import tinyword")
    (project / "trainer" / "requirements.txt").write_text("tinyword==1.0\n")
    failed = dflash(project, "setup", timeout=600)
    assert failed.returncode == 1, failed.stderr
    assert "pip could not install the requirements" in failed.stderr
    assert "[venv] wheels" in failed.stderr and "Traceback" not in failed.stderr
    folder = next((proxmox.root_dir(CT) / ROOT / "venvs").glob("*[!k]"))
    assert not (folder / ".complete").exists()  # an unfinished venv is never used
    assert "include-system-site-packages = true" in (folder / "pyvenv.cfg").read_text()
