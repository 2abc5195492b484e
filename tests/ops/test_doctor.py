"""`dflash doctor` and the checks before deploy, at real places: this machine, an SSH host on
loopback, and a container of the `pct` stand-in. Each check is made to fail the way a user's
machine fails (no tmux on PATH, no pct, a stopped container, no CUDA, a missing model folder, a
file or a read-only mount where the checkpoints go, an unknown host key) and must say what to do.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_ops.commands import doctor
from dflash_ops.connect.place import ContainerPlace, HostPlace
from dflash_ops.connect.transport import LocalTransport, SSHTransport
from dflash_ops.settings import project as project_settings
from dflash_ops.settings.deploy_config import TargetFlags, load_config, resolve_target
from tests.cli_helpers import container_defaults

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable  # has torch: the job's python in every test


def project(
    tmp_path: Path, *, target: str = 'place = "local"', job: str = "", train: str = "demo = true"
) -> Path:
    """A project folder with deploy.toml and trainer/ (a link to this checkout's)."""
    folder = tmp_path / "project"
    folder.mkdir(exist_ok=True)
    if not (folder / "trainer").exists():
        (folder / "trainer").symlink_to(REPO / "trainer")
    (folder / "deploy.toml").write_text(
        f'[target]\n{target}\n\n[job]\nsocket = "doctor-test"\n{job}\n\n[train]\n{train}\n'
    )
    return folder


def setup_of(folder: Path, **flags: object) -> doctor.Setup:
    config = load_config(folder / "deploy.toml")
    target = resolve_target(config, TargetFlags(**flags), remembered=None)  # type: ignore[arg-type]
    return doctor.Setup(
        target=target, job=config.job, train=config.train, project_dir=folder, min_free_gib=0.1
    )


def local_place() -> HostPlace:
    return HostPlace(LocalTransport())


def by_name(checks: list[doctor.Check]) -> dict[str, doctor.Check]:
    return {c.name: c for c in checks}


def dflash(
    folder: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ if env is None else env, PYTHONPATH=str(REPO))
    full.pop("DFLASH_CONFIG", None)
    return subprocess.run(
        [PYTHON, "-m", "dflash_ops", *args],
        cwd=folder,
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
    )


def local_target(tmp_path: Path) -> str:
    return f'place = "local"\npython = "{PYTHON}"\ncheckpoints = "{tmp_path}/ckpt"'


# --- local place ---------------------------------------------------------------------------------


def test_local_place_passes_every_check_with_the_cpu_smoke_test(tmp_path):
    folder = project(tmp_path, target=local_target(tmp_path))
    result = dflash(folder, "doctor", "--json", "--min-free-gib", "0.1")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    checks = {c["name"]: c for c in report["checks"]}
    assert set(checks) == {
        "tmux", "python", "imports", "torch", "cuda", "gpu count", "checkpoints", "target model",
        "train config", "gpu smoke test",
    }  # fmt: skip
    assert all(c["ok"] and c["status"] == "passed" and c["fix"] == "" for c in checks.values())
    assert torch.__version__ in checks["torch"]["detail"]
    assert "demo" in checks["target model"]["detail"]
    assert "demo" in checks["train config"]["detail"]
    smoke = checks["gpu smoke test"]["detail"]
    assert ("cpu" in smoke) != torch.cuda.is_available()
    assert (tmp_path / "ckpt").is_dir()
    # the scratch copy of trainer/ is gone again
    assert not any((folder / ".dflash" / "local" / "doctor").glob("*"))


def test_human_output_marks_each_line_and_exit_code_is_1_on_failure(tmp_path):
    folder = project(
        tmp_path,
        target=local_target(tmp_path),
        train='[train.model]\ntarget = "/nonexistent/model"',
    )
    result = dflash(folder, "doctor", "--no-gpu-smoke", "--min-free-gib", "0.1")
    assert result.returncode == 1
    assert "✓ tmux" in result.stdout
    assert "✗ target model" in result.stdout
    assert "fix:" in result.stdout and "[train.model] target" in result.stdout
    assert "✗ train config: [train] data.path: set the training data file" in result.stdout
    assert "2 checks failed" in result.stderr


def tools_without(tmp_path: Path, *hidden: str) -> str:
    """A PATH folder holding every tool of this machine except `hidden` (as on a box without them)."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for directory in os.environ["PATH"].split(os.pathsep):
        base = Path(directory)
        if not base.is_dir():
            continue
        for tool in base.iterdir():
            if tool.name in hidden or (folder / tool.name).exists():
                continue
            if os.access(tool, os.X_OK) and not tool.is_dir():
                (folder / tool.name).symlink_to(tool)
    return str(folder)


def test_no_tmux_on_path_fails_with_the_install_command(tmp_path, monkeypatch):
    folder = project(tmp_path, target=local_target(tmp_path))
    monkeypatch.setenv("PATH", tools_without(tmp_path, "tmux"))
    checks = by_name(doctor.diagnose(setup_of(folder), local_place(), gpu_smoke=False))
    assert checks["tmux"].status == "failed"
    assert "tmux is not installed" in checks["tmux"].detail
    assert "apt-get install -y tmux" in checks["tmux"].fix
    assert checks["python"].ok and checks["checkpoints"].ok  # the others still run


def test_deploy_stops_at_the_cheap_checks_with_the_doctor_message(tmp_path):
    folder = project(tmp_path, target=local_target(tmp_path), job='command = "sleep 1"')
    env = dict(os.environ, PATH=tools_without(tmp_path, "tmux"))
    deploy = dflash(folder, "deploy", env=env)
    assert deploy.returncode == 1
    assert "error: tmux: tmux is not installed" in deploy.stderr
    assert "hint: Install it: apt-get install -y tmux" in deploy.stderr
    assert not (folder / ".dflash" / "local" / "releases").exists()  # nothing was touched
    doc = dflash(folder, "doctor", "--json", "--no-gpu-smoke", env=env)
    tmux = next(c for c in json.loads(doc.stdout)["checks"] if c["name"] == "tmux")
    assert tmux["detail"] in deploy.stderr and tmux["fix"] in deploy.stderr


def test_missing_python_skips_what_depends_on_it(tmp_path):
    folder = project(tmp_path, target='place = "local"\npython = "/opt/no-such-python/bin/python3"')
    checks = by_name(doctor.diagnose(setup_of(folder), local_place()))
    assert checks["python"].status == "failed"
    assert "/opt/no-such-python/bin/python3 does not run" in checks["python"].detail
    assert 'set python = "/path/to/python"' in checks["python"].fix
    for name in ("torch", "cuda", "gpu count", "gpu smoke test"):
        assert checks[name].status == "skipped" and not checks[name].ok
    assert checks["tmux"].ok


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_no_cuda_with_gpus_configured_fails_with_the_fix(tmp_path):
    folder = project(tmp_path, target=local_target(tmp_path), job="gpus = 8\ntarget_gpus = 5")
    result = dflash(folder, "doctor", "--json", "--min-free-gib", "0.1")
    assert result.returncode == 1
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    cuda = checks["cuda"]
    assert cuda["status"] == "failed"
    assert "no CUDA" in cuda["detail"] and "[job] gpus = 8" in cuda["detail"]
    assert "nvidia-smi" in cuda["fix"] and "set [job] gpus = 0" in cuda["fix"]
    assert checks["gpu count"]["status"] == "skipped"
    smoke = checks["gpu smoke test"]
    assert smoke["status"] == "failed" and "only the CPU path ran" in smoke["detail"]
    assert checks["tmux"]["ok"] and checks["checkpoints"]["ok"]


def test_smoke_report_without_cuda_fails_only_when_gpus_are_wanted():
    report = {
        "ok": True,
        "cuda": False,
        "path": "SDPA",
        "device": "cpu",
        "rel_errors": {"loss": 1e-7},
    }
    assert doctor.smoke_check(report, gpus=0).ok
    assert not doctor.smoke_check(report, gpus=1).ok
    broken = dict(report, ok=False, error="relative error above the bound for grad_q")
    check = doctor.smoke_check(broken, gpus=0)
    assert not check.ok and "grad_q" in check.detail and "python -m trainer smoke" in check.fix


def test_missing_model_folder(tmp_path):
    folder = project(
        tmp_path,
        target=local_target(tmp_path),
        train='[train.model]\ntarget = "/srv/models/missing"',
    )
    checks = by_name(doctor.diagnose(setup_of(folder), local_place(), gpu_smoke=False))
    model = checks["target model"]
    assert model.status == "failed"
    assert "/srv/models/missing does not exist" in model.detail
    assert "Copy the model" in model.fix and "[train.model] target" in model.fix


def test_no_model_configured_says_which_key(tmp_path):
    folder = project(tmp_path, target=local_target(tmp_path), train="")
    model = by_name(doctor.diagnose(setup_of(folder), local_place(), gpu_smoke=False))[
        "target model"
    ]
    assert not model.ok and "[train.model] target is not set" in model.detail


def write_model(folder: Path, config: dict[str, object], *, weights: bool = True) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights:
        (folder / "model.safetensors").write_bytes(b"\0" * 16)
    return folder


QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256,
    "num_attention_heads": 8, "num_key_value_heads": 2, "num_hidden_layers": 6,
    "intermediate_size": 512, "vocab_size": 1000,
}  # fmt: skip


def test_model_folder_with_a_config_the_drafter_can_use(tmp_path):
    model = write_model(tmp_path / "models" / "qwen", QWEN3)
    folder = project(
        tmp_path, target=local_target(tmp_path), train=f'[train.model]\ntarget = "{model}"'
    )
    check = by_name(doctor.diagnose(setup_of(folder), local_place(), gpu_smoke=False))[
        "target model"
    ]
    assert check.ok, check
    assert "Qwen3ForCausalLM: 6 layers, hidden 256, 8 heads (2 kv)" in check.detail


@pytest.mark.parametrize(
    ("change", "weights", "words"),
    [
        ({"hidden_size": None}, True, "hidden_size"),
        ({"num_key_value_heads": 3}, True, "does not divide"),
        ({}, False, "no weights"),
    ],
    ids=["no-hidden-size", "bad-kv-heads", "no-weights"],
)
def test_model_folder_the_drafter_cannot_be_built_from(tmp_path, change, weights, words):
    config = {k: v for k, v in {**QWEN3, **change}.items() if v is not None}
    model = write_model(tmp_path / "m", config, weights=weights)
    folder = project(
        tmp_path, target=local_target(tmp_path), train=f'[train.model]\ntarget = "{model}"'
    )
    check = by_name(doctor.diagnose(setup_of(folder), local_place(), gpu_smoke=False))[
        "target model"
    ]
    assert not check.ok and words in check.detail and check.fix


def test_target_layers_beyond_the_model_are_refused(tmp_path):
    model = write_model(tmp_path / "m", QWEN3)
    train = f'[train.model]\ntarget = "{model}"\ntarget_layers = [1, 3, 9]'
    folder = project(tmp_path, target=local_target(tmp_path), train=train)
    check = by_name(doctor.diagnose(setup_of(folder), local_place(), gpu_smoke=False))[
        "target model"
    ]
    assert not check.ok and "target_layers [9] outside 0…5" in check.detail
    assert "under [train.model] in deploy.toml" in check.fix


@pytest.mark.parametrize("kv_heads", [3, 4])
def test_the_drafters_key_value_heads_must_divide_the_targets_heads(tmp_path, kv_heads):
    model = write_model(tmp_path / "m", QWEN3)  # 8 heads
    train = f'[train.model]\ntarget = "{model}"\nnum_kv_heads = {kv_heads}'
    folder = project(tmp_path, target=local_target(tmp_path), train=train)
    check = by_name(doctor.diagnose(setup_of(folder), local_place(), gpu_smoke=False))[
        "target model"
    ]
    if kv_heads == 4:
        assert check.ok, check
    else:
        assert not check.ok and "under [train.model] in deploy.toml" in check.fix
        assert "num_kv_heads = 3 does not divide the target's 8 attention heads" in check.detail


def test_a_file_where_the_checkpoints_folder_should_be(tmp_path):
    (tmp_path / "ckpt").write_text("not a folder")
    folder = project(tmp_path, target=local_target(tmp_path))
    check = by_name(doctor.diagnose(setup_of(folder), local_place(), gpu_smoke=False))[
        "checkpoints"
    ]
    assert check.status == "failed"
    assert f"{tmp_path}/ckpt is a file, not a folder" in check.detail
    assert "set checkpoints in the target's table" in check.fix


def test_checkpoints_on_a_too_small_disk(tmp_path):
    folder = project(tmp_path, target=local_target(tmp_path))
    setup = setup_of(folder)
    tiny = doctor.Setup(
        target=setup.target, job=setup.job, train=setup.train, project_dir=folder,
        min_free_gib=1e9,
    )  # fmt: skip
    check = by_name(doctor.diagnose(tiny, local_place(), gpu_smoke=False))["checkpoints"]
    assert not check.ok and "GiB free" in check.detail and "Free some space" in check.fix


# --- ssh place -----------------------------------------------------------------------------------


def ssh_project(tmp_path: Path, host: str, *, extra: str = "") -> Path:
    target = (
        f'place = "ssh"\nhost = "{host}"\npython = "{PYTHON}"\n'
        f'root = "{tmp_path}/remote"\ncheckpoints = "{tmp_path}/remote-ckpt"\n{extra}'
    )
    return project(tmp_path, target=target)


def test_ssh_place_passes_with_the_smoke_test(ssh_home, tmp_path):
    folder = ssh_project(tmp_path, "testbox")
    place = HostPlace(SSHTransport("testbox"))
    try:
        checks = doctor.diagnose(setup_of(folder), place)
    finally:
        place.close()
    assert [c.name for c in checks][0] == "ssh"
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    assert "reachable, host key known" in checks[0].detail
    assert (tmp_path / "remote-ckpt").is_dir()
    assert not any((tmp_path / "remote" / "doctor").glob("*"))


def test_unknown_host_key_is_refused_with_its_fingerprint_and_the_flag(ssh_home, sshd, tmp_path):
    folder = ssh_project(tmp_path, "unknownbox")
    result = dflash(folder, "doctor", "--json", env=dict(os.environ))
    assert result.returncode == 1
    checks = json.loads(result.stdout)["checks"]
    first = checks[0]
    assert first["name"] == "ssh" and first["status"] == "failed"
    assert sshd.host_key_fingerprint in first["detail"]
    assert "--accept-new-host-key" in first["fix"]
    assert all(c["status"] == "skipped" for c in checks[1:])
    assert "unknownbox" not in ssh_home.empty_known_hosts.read_text()  # never added silently


# --- proxmox place -------------------------------------------------------------------------------


def lend_python(proxmox, ct: int) -> None:
    """Make this interpreter (and its torch) visible inside container `ct`.

    A container's /root and /tmp are its own, so an interpreter installed under the host's
    /root (pyenv, a venv in a home folder) or /tmp (a checkout there) is missing inside, as on
    a fresh container. Bind-mount those folders, read-only, into the container's mount namespace
    (the stand-in builds the container's root at `ct/<ct>/mnt`, its init's pid is in
    `run/<ct>.pid`; the host's folders keep their paths in that namespace).
    """
    pid = (proxmox.state / "run" / f"{ct}.pid").read_text().strip()
    tops = set()
    for path in (sys.prefix, sys.base_prefix, os.path.realpath(sys.executable)):
        parts = Path(path).parts
        if len(parts) > 2 and parts[1] in ("root", "tmp"):
            tops.add(Path("/", parts[1], parts[2]))
    mnt = proxmox.state / "ct" / str(ct) / "mnt"
    for top in sorted(tops):
        inside = mnt / top.relative_to("/")
        for argv in (
            ["mkdir", "-p", str(inside)],
            ["mount", "--bind", "-o", "ro", str(top), str(inside)],
        ):
            subprocess.run(["nsenter", "-t", pid, "-m", *argv], check=True)


def pve_project(tmp_path: Path, *, host: str = "pvehost", ct: int = 200) -> Path:
    target = f'place = "proxmox"\nhost = "{host}"\nct = {ct}\npython = "{PYTHON}"'
    return project(tmp_path, target=target)


def test_proxmox_container_passes_with_the_smoke_test(proxmox, tmp_path):
    proxmox.create(200)
    lend_python(proxmox, 200)
    folder = pve_project(tmp_path)
    place = ContainerPlace(SSHTransport(proxmox.alias), 200)
    try:
        checks = doctor.diagnose(setup_of(folder), place)
    finally:
        place.close()
    assert [c.name for c in checks][:3] == ["ssh", "container", "tmux"]
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]
    root, checkpoints = container_defaults(proxmox, 200, folder)
    assert checkpoints.is_dir()  # /workspace/dflash/<project> inside
    assert not any((root / "doctor").glob("*"))


def test_stopped_container(proxmox, tmp_path):
    proxmox.create(200, running=False)
    folder = pve_project(tmp_path)
    result = dflash(folder, "doctor", "--json", env=dict(os.environ))
    assert result.returncode == 1
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["ssh"]["ok"]
    assert checks["container"]["status"] == "failed"
    assert "Container 200" in checks["container"]["detail"]
    assert "pct start 200" in checks["container"]["fix"]
    assert checks["tmux"]["status"] == checks["python"]["status"] == "skipped"
    deploy = dflash(folder, "deploy", env=dict(os.environ))
    assert deploy.returncode == 1
    assert checks["container"]["detail"] in deploy.stderr and "pct start 200" in deploy.stderr


def test_host_without_pct(proxmox, tmp_path):
    folder = pve_project(tmp_path, host=proxmox.no_pct_alias)
    checks = by_name(
        doctor.diagnose(setup_of(folder), ContainerPlace(SSHTransport("testbox"), 200))
    )
    container = checks["container"]
    assert container.status == "failed"
    assert "has no `pct` command" in container.detail
    assert 'place = "ssh"' in container.fix
    assert checks["tmux"].skipped and checks["gpu smoke test"].skipped


def test_read_only_checkpoints_mount_in_the_container(proxmox, tmp_path):
    proxmox.create(200)
    folder = pve_project(tmp_path)
    _, host_path = container_defaults(proxmox, 200, folder)
    host_path.mkdir(parents=True)
    inside = project_settings.load(folder).remote_checkpoints
    for argv in (["mount", "--bind", inside, inside], ["mount", "-o", "remount,bind,ro", inside]):
        assert proxmox.exec_in(200, argv).returncode == 0
    place = ContainerPlace(SSHTransport(proxmox.alias), 200)
    try:
        checks = by_name(doctor.diagnose(setup_of(folder), place, gpu_smoke=False))
    finally:
        place.close()
    check = checks["checkpoints"]
    assert check.status == "failed"
    assert f"{inside} is not writable" in check.detail
    assert "Read-only file system" in check.detail
    assert "read-only mount" in check.fix
