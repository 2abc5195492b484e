"""Bundles, the generated launch script, and releases on the local place (real tar, real bash;
releases pushed, switched and pruned by the site program's deploy)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import tarfile
import tomllib
from pathlib import Path

import pytest

from dflash_ops.errors import ReleaseError
from dflash_ops.remote.launch import LaunchPlan, render
from dflash_ops.remote.release import RELEASE_ID, build_bundle, new_release_id
from tests.site_helpers import Site, site_fixture, tmux_socket_fixture  # noqa: F401

TRAIN = {"steps": 3, "model": {"layers": 2, "name": "tiny"}, "lr": 1e-3, "tags": ["a", "b"]}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    folder = tmp_path / "project"
    (folder / "trainer" / "__pycache__").mkdir(parents=True)
    (folder / "trainer" / "__init__.py").write_text("")
    (folder / "trainer" / "__main__.py").write_text("print('train')\n")
    (folder / "trainer" / "__pycache__" / "__main__.cpython-311.pyc").write_bytes(b"\0")
    (folder / "trainer" / "stale.pyc").write_bytes(b"\0")
    return folder


def plan(**overrides: object) -> LaunchPlan:
    values: dict[str, object] = {
        "release_id": new_release_id(),
        "python": "python3",
        "checkpoints": "/ck",
    }
    values.update(overrides)
    return LaunchPlan(**values)  # type: ignore[arg-type]


def members(data: bytes) -> dict[str, tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: m for m in tar.getmembers()}


def read(data: bytes, name: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        handle = tar.extractfile(name)
        assert handle is not None
        return handle.read()


def test_bundle_contents(project: Path) -> None:
    bundle = build_bundle(project, plan=plan(), train=TRAIN, target="local")
    names = members(bundle.data)
    assert {"trainer/__init__.py", "trainer/__main__.py", "train.toml", "launch.sh"} <= set(names)
    assert "RELEASE.json" in names and "command.sh" not in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)
    assert names["launch.sh"].mode == 0o755
    assert tomllib.loads(read(bundle.data, "train.toml").decode()) == TRAIN
    meta = json.loads(read(bundle.data, "RELEASE.json"))
    assert meta["id"] == bundle.release_id and "@" in meta["by"] and meta["target"] == "local"
    assert "created" in meta and "source" in meta


def test_bundle_without_trainer_needs_a_command(tmp_path: Path) -> None:
    with pytest.raises(ReleaseError, match="__main__.py"):
        build_bundle(tmp_path, plan=plan(), train={}, target="local")
    bundle = build_bundle(tmp_path, plan=plan(command="echo hi"), train={}, target="local")
    assert read(bundle.data, "command.sh") == b"echo hi\n"


def test_release_ids_sort_by_time() -> None:
    ids = [new_release_id() for _ in range(3)]
    assert all(RELEASE_ID.fullmatch(i) for i in ids)
    assert ids[0][:19] <= ids[-1][:19]


def run_launch(
    tmp_path: Path,
    launch_plan: LaunchPlan,
    *,
    command_text: str | None = None,
    env: dict[str, str] | None = None,
) -> str:
    """Unpack a launch script into a release folder and run it with a stand-in interpreter."""
    release = tmp_path / "releases" / launch_plan.release_id
    release.mkdir(parents=True)
    (release / "launch.sh").write_text(render(launch_plan))
    if command_text is not None:
        (release / "command.sh").write_text(command_text + "\n")
    (tmp_path / "current").symlink_to(f"releases/{launch_plan.release_id}")
    result = subprocess.run(
        ["bash", str(tmp_path / "current" / "launch.sh")],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=30,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture
def fake_python(tmp_path: Path) -> Path:
    """Prints its cwd, argv and the DFLASH_* and CUDA_* environment, one per line."""
    script = tmp_path / "bin" / "fake python"
    script.parent.mkdir()
    script.write_text(
        '#!/bin/bash\npwd\nfor a in "$@"; do echo "arg:$a"; done\nenv | grep -E "^(DFLASH|CUDA)_" | sort\n'
    )
    script.chmod(0o755)
    return script


def test_launch_single_process(tmp_path: Path, fake_python: Path) -> None:
    ckpt = "/data/it's $(here) ; x"
    launch_plan = plan(python=str(fake_python), checkpoints=ckpt, gpus=1)
    out = run_launch(tmp_path, launch_plan).splitlines()
    release = tmp_path / "releases" / launch_plan.release_id
    assert out[0] == str(release)  # cd -P into the release itself
    args = [line[4:] for line in out if line.startswith("arg:")]
    assert args == ["-m", "trainer", "train", "--config", "train.toml", "--out", ckpt]
    assert f"DFLASH_CHECKPOINTS={ckpt}" in out
    assert f"DFLASH_RELEASE={launch_plan.release_id}" in out
    assert not any(line.startswith("DFLASH_TARGET_GPUS") for line in out)


def test_launch_torchrun_over_gpus(tmp_path: Path, fake_python: Path) -> None:
    out = run_launch(tmp_path, plan(python=str(fake_python), gpus=8, target_gpus=5)).splitlines()
    args = [line[4:] for line in out if line.startswith("arg:")]
    assert args[:6] == ["-m", "trainer", "launch", "--standalone", "--nproc-per-node", "8"]
    assert args[6:] == ["-m", "trainer", "train", "--config", "train.toml", "--out", "/ck"]
    assert "DFLASH_TARGET_GPUS=5" in out and not any(x.startswith("DFLASH_GPUS") for x in out)


@pytest.mark.parametrize(("gpus", "visible"), [(0, ""), (1, "0,1"), (2, "0,1")])
def test_a_cpu_job_sees_no_gpu(tmp_path: Path, fake_python: Path, gpus: int, visible: str) -> None:
    """`[job] gpus = 0` hides the GPUs from the job (whatever the environment held before), so
    the trainer's `run.device = "auto"` picks the CPU; with GPUs the environment is left as is."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"}
    out = run_launch(tmp_path, plan(python=str(fake_python), gpus=gpus), env=env).splitlines()
    assert f"CUDA_VISIBLE_DEVICES={visible}" in out


def test_launch_runs_the_users_command_with_bash(tmp_path: Path) -> None:
    text = 'echo "in $(basename "$PWD")"; echo "$DFLASH_CHECKPOINTS"'
    launch_plan = plan(command=text)
    out = run_launch(tmp_path, launch_plan, command_text=text)
    assert out == f"in {launch_plan.release_id}\n/ck\n"


def push(site: Site, project: Path) -> str:
    """One deploy of a fresh bundle through the site program; its job runs `true`."""
    bundle = build_bundle(project, plan=plan(), train=TRAIN, target="local")
    site.deploy(bundle)
    return bundle.release_id


def test_push_switch_and_keep_five(site: Site, project: Path, tmp_path: Path) -> None:
    releases = site.releases
    assert releases.current() is None
    with pytest.raises(ReleaseError, match="Nothing is deployed"):
        releases.require_current()
    ids = [push(site, project) for _ in range(7)]
    assert releases.list() == sorted(ids)[-5:]
    assert releases.current() == ids[-1]
    current = tmp_path / "root" / "current"
    assert os.readlink(current) == f"releases/{ids[-1]}"
    assert (current / "trainer" / "__main__.py").read_text() == "print('train')\n"
    assert tomllib.loads((current / "train.toml").read_text()) == TRAIN


def test_a_failed_unpack_or_switch_keeps_current_and_names_the_step(
    site: Site, project: Path, tmp_path: Path
) -> None:
    """The deploy unpacks and switches in one command; its error still says which step failed,
    `current` stays, and the next deploy removes the interrupted unpack."""
    releases = site.releases
    good = push(site, project)
    broken = build_bundle(project, plan=plan(), train=TRAIN, target="local")
    truncated = type(broken)(release_id=broken.release_id, data=broken.data[:700], meta={})
    with pytest.raises(ReleaseError, match="Could not unpack") as unpack:
        site.deploy(truncated)  # the stream ended early: tar fails
    assert "current release is unchanged" in unpack.value.hint
    assert releases.current() == good
    assert (tmp_path / "root" / "releases" / f"{broken.release_id}.tmp").exists()
    newer = push(site, project)
    assert releases.current() == newer
    assert not list((tmp_path / "root" / "releases").glob("*.tmp"))

    current = tmp_path / "root" / "current"
    current.unlink()
    current.mkdir()  # a folder where the link belongs: `mv -T` cannot replace it
    fresh = build_bundle(project, plan=plan(), train=TRAIN, target="local")
    with pytest.raises(ReleaseError, match=f"Could not switch .* to release {fresh.release_id}"):
        site.deploy(fresh)
    assert current.is_dir() and not current.is_symlink()
    assert (tmp_path / "root" / "releases" / fresh.release_id / ".complete").exists()


def test_prune_keeps_current_and_the_rollback_target(
    site: Site, project: Path, tmp_path: Path
) -> None:
    keep_one = site.with_(keep=1)
    ids = [push(keep_one, project) for _ in range(3)]
    assert site.releases.list() == ids[1:]  # the newest one stays, and so does the one before
    (tmp_path / "root" / "releases" / "not-a-release").mkdir()  # never an id: never pruned
    push(keep_one, project)
    assert (tmp_path / "root" / "releases" / "not-a-release").is_dir()


@pytest.mark.gpu
def test_a_cpu_job_trains_on_the_cpu_on_a_gpu_machine(tmp_path: Path) -> None:
    """On a machine with a GPU, the job of `[job] gpus = 0` resolves `run.device = "auto"` to
    the CPU (the trainer's own rule, run under the launch script)."""
    import sys

    root = Path(__file__).resolve().parents[2]
    text = (
        f"{sys.executable} -c 'from trainer.run.trainer import resolve_device; "
        'print(resolve_device("auto"))\''
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    for gpus, device in ((0, "cpu"), (1, "cuda")):
        launch_plan = plan(command=text, gpus=gpus)
        out = run_launch(tmp_path / str(gpus), launch_plan, command_text=text, env=env)
        assert out.strip() == device
