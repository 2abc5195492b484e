"""`dflash init`: the written deploy.toml loads with the project's loader and says what was found
at the place; an existing file is kept unless --force."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from dflash_ops.commands import init
from dflash_ops.connect.place import HostPlace
from dflash_ops.connect.transport import LocalTransport
from dflash_ops.settings.deploy_config import TargetFlags, load_config, resolve_target

REPO = Path(__file__).resolve().parents[2]


def dflash(
    folder: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    full = dict(os.environ if env is None else env, PYTHONPATH=str(REPO))
    full.pop("DFLASH_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "dflash_ops", *args],
        cwd=folder,
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
    )


def loaded(path: Path):
    config = load_config(path)
    return config, resolve_target(config, TargetFlags(), remembered=None)


def nvidia_smi(tmp_path: Path, names: list[str]) -> dict[str, str]:
    """An environment whose PATH has an `nvidia-smi` answering the query as a GPU box would."""
    folder = tmp_path / "gpu-bin"
    folder.mkdir()
    script = folder / "nvidia-smi"
    lines = "".join(f"{name}\n" for name in names)
    script.write_text(
        "#!/bin/sh\n"
        '[ "$1" = --query-gpu=name ] && [ "$2" = --format=csv,noheader ] || exit 2\n'
        f"printf '%s' '{lines}'\n"
    )
    script.chmod(0o755)
    return dict(os.environ, PATH=f"{folder}{os.pathsep}{os.environ['PATH']}")


def test_local_init_writes_a_file_that_loads(tmp_path):
    result = dflash(tmp_path, "init")
    assert result.returncode == 0, result.stderr
    config, target = loaded(tmp_path / "deploy.toml")
    assert target.place == "local"
    assert config.job.gpus == 0 and config.job.target_gpus == 0  # this machine: no nvidia-smi
    assert config.train == {"demo": True}
    text = (tmp_path / "deploy.toml").read_text()
    assert "no nvidia-smi" in text and text.count("#") > 15  # commented


def test_gpu_count_is_read_from_the_place_and_split(tmp_path):
    env = nvidia_smi(tmp_path, ["NVIDIA H200"] * 8)
    result = dflash(tmp_path, "init", "--model", "/models/Qwen3 8B", env=env)
    assert result.returncode == 0, result.stderr
    config, _ = loaded(tmp_path / "deploy.toml")
    # the split is the trainer's to pick once it reads the model (8B: 4 + 4, 27B: 6 + 2)
    assert (config.job.gpus, config.job.target_gpus) == (8, 0)
    assert config.train == {"model": {"target": "/models/Qwen3 8B"}, "data": {}}  # path to set
    assert "8 × NVIDIA H200" in (tmp_path / "deploy.toml").read_text()


def test_count_gpus_at_a_place_without_nvidia_smi():
    info = init.count_gpus(HostPlace(LocalTransport()))
    assert info.count == 0 and "no nvidia-smi" in info.note


def test_refuses_to_overwrite_then_force_overwrites(tmp_path):
    path = tmp_path / "deploy.toml"
    path.write_text("# mine\n")
    refused = dflash(tmp_path, "init")
    assert refused.returncode == 1
    assert "already exists; not overwriting it" in refused.stderr and "--force" in refused.stderr
    assert path.read_text() == "# mine\n"
    forced = dflash(tmp_path, "init", "--force")
    assert forced.returncode == 0, forced.stderr
    assert path.read_text() != "# mine\n"
    loaded(path)


def test_config_flag_names_the_file(tmp_path):
    result = dflash(tmp_path, "--config", "sub/other.toml", "init")
    assert result.returncode == 0, result.stderr
    loaded(tmp_path / "sub" / "other.toml")
    assert not (tmp_path / "deploy.toml").exists()


def test_ssh_and_proxmox_places(ssh_home, proxmox, tmp_path):
    proxmox.create(200)
    ssh = dflash(tmp_path, "--config", "ssh.toml", "init", "--host", "testbox", "--user", "root")
    assert ssh.returncode == 0, ssh.stderr
    _, target = loaded(tmp_path / "ssh.toml")
    assert (target.place, target.host, target.user) == ("ssh", "testbox", "root")
    assert "Could not" not in ssh.stderr
    pve = dflash(tmp_path, "--config", "pve.toml", "init", "--host", "pvehost", "--ct", "200")
    assert pve.returncode == 0, pve.stderr
    config, target = loaded(tmp_path / "pve.toml")
    assert (target.place, target.host, target.ct) == ("proxmox", "pvehost", 200)
    assert config.job.gpus == 0


def test_unreachable_place_still_writes_with_a_warning(ssh_home, tmp_path):
    result = dflash(tmp_path, "init", "--host", "unknownbox")
    assert result.returncode == 0, result.stderr
    assert (
        "Could not read the GPU count" in result.stderr and "--accept-new-host-key" in result.stderr
    )
    assert "GPUs NOT COUNTED (gpus = 0)" in result.stderr
    assert "The GPUs of unknownbox were not counted (the place did not answer)" in result.stderr
    assert "dflash init --force --host unknownbox" in result.stderr
    config, target = loaded(tmp_path / "deploy.toml")
    assert target.host == "unknownbox" and config.job.gpus == 0
    text = (tmp_path / "deploy.toml").read_text()
    assert "# GPUS NOT COUNTED: the place did not answer." in text


def test_a_driver_that_does_not_answer_is_not_a_count(tmp_path):
    folder = tmp_path / "smi"
    folder.mkdir()
    standin = REPO / "tests" / "fixtures" / "nvidia_smi_standin" / "nvidia-smi"
    (folder / "nvidia-smi").write_bytes(standin.read_bytes())
    (folder / "nvidia-smi").chmod(0o755)
    (folder / "driver-down").touch()
    env = dict(os.environ, PATH=f"{folder}{os.pathsep}{os.environ['PATH']}")
    result = dflash(tmp_path, "init", env=env)
    assert result.returncode == 0, result.stderr
    assert "GPUs NOT COUNTED" in result.stderr and "nvidia-smi failed: NVIDIA-SMI has failed" in (
        result.stderr
    )
    text = (tmp_path / "deploy.toml").read_text()
    assert "# GPUS NOT COUNTED: nvidia-smi failed" in text and "gpus = 0" in text


@given(st.integers(min_value=2, max_value=512))
def test_the_written_split_leaves_the_trainer_to_pick(tmp_path_factory, gpus):
    """`target_gpus = 0` sets no DFLASH_TARGET_GPUS: the trainer's shape-based default runs."""
    from dflash_ops.remote.launch import LaunchPlan, exports

    path = tmp_path_factory.mktemp("split") / "deploy.toml"
    path.write_text(init.render(init.InitPlan(place="local", gpus=init.GpuInfo(count=gpus))))
    assert "the trainer picks the split" in path.read_text()
    config, _ = loaded(path)
    plan = LaunchPlan.for_job(config.job, release_id="r", python="python3", checkpoints="/c")
    assert plan.world_size == gpus and "DFLASH_TARGET_GPUS" not in exports(plan)


@given(st.integers(min_value=0, max_value=64), st.sampled_from([None, "/m", 'a "q" \\ x']))
def test_rendered_file_always_loads(tmp_path_factory, gpus, model):
    path = tmp_path_factory.mktemp("render") / "deploy.toml"
    plan = init.InitPlan(
        place="proxmox", host="pve", user="root", port=2222, ct=200,
        gpus=init.GpuInfo(count=gpus, names=("GPU",) * gpus), model=model,
    )  # fmt: skip
    path.write_text(init.render(plan))
    config, target = loaded(path)
    assert config.job.gpus == gpus and target.ct == 200 and target.port == 2222
    assert config.job.target_gpus == 0
    if model is not None:
        assert config.train["model"]["target"] == model


def trainer_check(config: Path) -> subprocess.CompletedProcess[str]:
    """The trainer's own check of the written file (as deploy and doctor run it)."""
    return subprocess.run(
        [sys.executable, "-m", "trainer", "check", "--config", str(config)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_init_with_model_and_data_writes_a_config_that_passes_the_check(tmp_path):
    from trainer.data.formats import Sample, write_samples
    from trainer.settings.config import DemoConfig
    from trainer.setup.demo import build_target, build_tokenizer

    model, data = tmp_path / "model", tmp_path / "train.jsonl"
    build_target(model, DemoConfig(enabled=True, num_layers=4))
    build_tokenizer(model)
    write_samples(data, [Sample([1, 2, 3], [False, True, True])])
    result = dflash(tmp_path, "init", "--model", str(model), "--data", str(data))
    assert result.returncode == 0, result.stderr
    assert "data.path is not set" not in result.stderr + result.stdout
    config, _ = loaded(tmp_path / "deploy.toml")
    assert config.train["data"] == {"path": str(data)}
    check = trainer_check(tmp_path / "deploy.toml")
    assert check.returncode == 0, check.stderr
    assert f"ok: data {data}: tokenized JSONL" in check.stdout


def test_init_without_data_leaves_a_placeholder_the_check_flags(tmp_path):
    result = dflash(tmp_path, "init", "--model", "/models/m")
    assert result.returncode == 0, result.stderr
    assert "data.path is not set" in result.stderr + result.stdout
    assert '# path = "/data/chat.jsonl"' in (tmp_path / "deploy.toml").read_text()
    check = trainer_check(tmp_path / "deploy.toml")
    assert check.returncode == 2 and "data.path: set the training data file" in check.stderr
    (tmp_path / "other").mkdir()
    refused = dflash(tmp_path / "other", "init", "--data", "/d.jsonl")
    assert refused.returncode == 1 and "--data needs --model" in refused.stderr
