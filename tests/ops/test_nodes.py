"""Several nodes: `[job] nodes` and `[job] rendezvous` in deploy.toml, the torchrun line of the
generated launch.sh, and two "nodes" on this machine meeting at a c10d rendezvous on 127.0.0.1
and training a few steps of the tiny demo on the CPU through that very launch.sh."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dflash_ops.errors import ConfigError
from dflash_ops.remote.launch import TRAIN_CONFIG, LaunchPlan, render, trainer_argv
from dflash_ops.remote.release import new_release_id
from dflash_ops.settings.deploy_config import load_config

ROOT = Path(__file__).resolve().parents[2]


def job(tmp_path: Path, text: str):
    path = tmp_path / "deploy.toml"
    path.write_text("[job]\n" + text)
    return load_config(path).job


@pytest.mark.parametrize(
    "endpoint",
    ["node0:29400", "10.0.0.1:1", "gpu-7.cluster.example:65535", "[fd00::1]:29400", "[::1]:80"],
)
def test_several_nodes_with_a_rendezvous(tmp_path: Path, endpoint: str) -> None:
    got = job(tmp_path, f'gpus = 8\ntarget_gpus = 10\nnodes = 2\nrendezvous = "{endpoint}"\n')
    assert (got.nodes, got.rendezvous, got.gpus, got.target_gpus) == (2, endpoint, 8, 10)


def test_one_node_by_default(tmp_path: Path) -> None:
    got = job(tmp_path, "gpus = 2\n")
    assert (got.nodes, got.rendezvous) == (1, None)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("nodes = 0\n", "'job.nodes'"),
        ("nodes = -2\n", "'job.nodes'"),
        ("nodes = '2'\n", "'job.nodes'"),
        ("nodes = 2.0\n", "'job.nodes'"),
        ('rendezvous = "h:29400"\n', "'job.rendezvous'"),  # one node: nothing to meet
        ('nodes = 1\nrendezvous = "h:29400"\n', "'job.rendezvous'"),
        ("gpus = 8\nnodes = 2\n", "'job.rendezvous' in"),  # missing
        ('nodes = 2\nrendezvous = "h:1"\n', "'job.gpus'"),  # CPU: processes per node unknown
        ('gpus = 8\nnodes = 2\nrendezvous = "h:1"\ntarget_gpus = 16\n', "'job.target_gpus'"),
        ("gpus = 8\nnodes = 2\nrendezvous = 29400\n", "'job.rendezvous'"),
    ]
    + [
        (f'gpus = 8\nnodes = 2\nrendezvous = "{bad}"\n', "'job.rendezvous'")
        for bad in (
            "node0",  # no port
            "node0:",
            ":29400",  # no host
            "node0:0",
            "node0:65536",
            "node0:29400x",
            "node0:+1",
            "node0:٣",  # a digit, but not an ASCII one
            "-node0:29400",
            "node_0:29400",
            "node0.:29400",
            "no de:29400",
            "a;b:29400",
            "$(x):29400",
            "300.1.1.1:29400",
            "1.2.3:29400",  # digits and dots, not an IPv4 address
            "fd00::1:29400",  # IPv6 without brackets
            "[fd00::zz]:29400",
            "[node0]:29400",
            "x" * 254 + ":29400",
        )
    ],
)
def test_node_errors_name_the_key_and_file(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        job(tmp_path, text)
    assert words in str(info.value)
    assert str(tmp_path / "deploy.toml") in str(info.value)


def plan(**fields: object) -> LaunchPlan:
    values: dict[str, object] = {
        "release_id": new_release_id(),
        "python": "py",
        "checkpoints": "/ck",
    }
    return LaunchPlan(**{**values, **fields})  # type: ignore[arg-type]


def test_launch_plan_of_a_job(tmp_path: Path) -> None:
    config = job(
        tmp_path, 'session = "run-7"\ngpus = 8\ntarget_gpus = 9\nnodes = 2\nrendezvous = "n0:1"\n'
    )
    got = LaunchPlan.for_job(config, release_id="r", python="py", checkpoints="/ck")
    assert (got.gpus, got.target_gpus, got.nodes, got.rendezvous, got.rdzv_id) == (
        8, 9, 2, "n0:1", "run-7",
    )  # fmt: skip
    assert got.world_size == 16


def test_launch_over_several_nodes() -> None:
    argv = trainer_argv(
        plan(gpus=8, target_gpus=10, nodes=2, rendezvous="[fd00::1]:29400", rdzv_id="run-7")
    )
    train = ["-m", "trainer", "train", "--config", TRAIN_CONFIG, "--out", "/ck"]
    assert argv == [
        "py", "-m", "trainer", "launch", "--nnodes", "2", "--nproc-per-node", "8",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", "[fd00::1]:29400", "--rdzv-id", "run-7",
        *train,
    ]  # fmt: skip
    assert "--standalone" not in argv
    # one node keeps torchrun's own store; one GPU needs no torchrun at all
    assert "--standalone" in trainer_argv(plan(gpus=8, target_gpus=5))
    assert trainer_argv(plan(gpus=1)) == ["py", *train]
    with pytest.raises(ValueError, match="rendezvous"):
        trainer_argv(plan(gpus=8, nodes=2))


def test_launch_script_exports_the_node_count() -> None:
    text = render(plan(gpus=4, target_gpus=3, nodes=3, rendezvous="n0:29400", rdzv_id="s"))
    assert "export DFLASH_NODES=3\n" in text and "export DFLASH_TARGET_GPUS=3\n" in text
    assert "--rdzv-endpoint n0:29400 --rdzv-id s " in text
    one = render(plan(gpus=4, target_gpus=1))
    assert "DFLASH_NODES" not in one and "export DFLASH_TARGET_GPUS=1\n" in one
    # no split given: the trainer's own default (half the ranks), never "0 targets"
    assert "DFLASH_TARGET_GPUS" not in render(plan(gpus=4))


def test_two_nodes_train_the_demo_on_the_cpu(tmp_path: Path) -> None:
    """Two launch.sh processes (one per "node", one process each: a target and a drafter) meet
    at 127.0.0.1 and train 4 steps; both exit 0 and the checkpoints and metrics are written."""
    from tests.trainer.test_split import DEMO, free_port, write_config
    from trainer.settings.config import DemoConfig
    from trainer.setup.demo import ensure_demo_assets

    assets = tmp_path / "assets"
    ensure_demo_assets(assets, DemoConfig(enabled=True, **DEMO))
    out = tmp_path / "checkpoints"
    launch = plan(
        python=sys.executable,
        checkpoints=str(out),
        gpus=1,
        target_gpus=1,
        nodes=2,
        rendezvous=f"127.0.0.1:{free_port()}",
        rdzv_id="dflash-nodes-test",
    )
    release = tmp_path / "releases" / launch.release_id
    shutil.copytree(ROOT / "trainer", release / "trainer", ignore=shutil.ignore_patterns("__py*"))
    write_config(release / TRAIN_CONFIG, assets, steps=4, checkpoint_every=2, log_every=2)
    (release / "launch.sh").write_text(render(launch))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
    }
    env.pop("PYTHONPATH", None)  # the release's own trainer/, found from its folder
    nodes = [
        subprocess.Popen(
            ["bash", str(release / "launch.sh")],
            env=env,
            cwd="/",
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)
    ]
    logs = []
    try:
        for node in nodes:
            logs.append(node.communicate(timeout=150)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.communicate()
    for node, log in zip(nodes, logs, strict=True):
        assert node.returncode == 0, log[-4000:]
    assert "step 4/4" in "".join(logs)
    assert (out / "step-00000004").is_dir()
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 2 and '"role": "target"' in rows[-1] and '"role": "drafter"' in rows[-1]


def test_deploy_writes_the_several_node_launch(tmp_path: Path) -> None:
    """`dflash deploy` builds its launch from the whole `[job]` table: nodes and rendezvous
    reach the release's launch.sh (the job then waits at the rendezvous for the other node)."""
    from tests.cli_helpers import dflash, kill_tmux_server
    from tests.trainer.test_split import free_port

    project = tmp_path / "project"
    project.mkdir()
    sock = f"dft-{uuid.uuid4().hex[:10]}"
    endpoint = f"127.0.0.1:{free_port()}"
    (project / "deploy.toml").write_text(
        f'[job]\nsocket = "{sock}"\ngpus = 1\ntarget_gpus = 1\nnodes = 2\n'
        f'rendezvous = "{endpoint}"\nstop_timeout = 3\n\n[train]\ndemo = true\n'
    )
    shutil.copytree(ROOT / "trainer", project / "trainer", ignore=shutil.ignore_patterns("__py*"))
    try:
        result = dflash(project, "deploy")
        assert result.returncode == 0, result.stderr
        text = (project / ".dflash" / "local" / "current" / "launch.sh").read_text()
        assert (
            f"--nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint {endpoint}" in text
        )
        assert "export DFLASH_NODES=2\n" in text and "export DFLASH_TARGET_GPUS=1\n" in text
        assert dflash(project, "stop").returncode == 0
    finally:
        kill_tmux_server(sock)
