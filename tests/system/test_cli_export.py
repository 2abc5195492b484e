"""`dflash export` end to end on the three places (this machine, the loopback SSH host, a
container of the `pct` stand-in): a checkpoint trained here is placed in the target's
checkpoints folder, exported there and streamed back; the folder equals a local export byte for
byte. Plus --keep-remote, the error cases, and an export killed midway."""

from __future__ import annotations

import filecmp
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

from tests.cli_helpers import REPO, container_defaults, default_sigint, dflash, kill_tmux_server
from tests.ops.test_doctor import lend_python
from tests.pty_helpers import Terminal
from trainer.export.folder import export
from trainer.run.trainer import Trainer
from trainer.settings.loading import config_from_dict

CT = 200
TRAIN = {
    "demo": {"enabled": True, "num_samples": 8, "num_layers": 2, "prompt_len": 6, "gen_len": 18},
    "model": {"num_layers": 1, "block_size": 4, "num_target_layers": 2},
    "data": {"batch_size": 8, "num_anchors": 8, "bucket": 32, "max_len": 32},
    "optim": {"lr": 1e-2, "warmup_steps": 1},
    "run": {"steps": 2, "device": "cpu", "threads": 1, "checkpoint_every": 0},
}


@dataclass
class Trained:
    run: Path  # run folder with step-00000002
    assets: Path
    reference: Path  # the same checkpoint exported here (fp32)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    base = tmp_path_factory.mktemp("trained")
    raw = {k: dict(v) for k, v in TRAIN.items()}
    raw["demo"]["folder"] = str(base / "assets")
    trainer = Trainer(config_from_dict(raw), base / "run", emit=lambda _: None)
    trainer.run()
    reference = export(trainer.config, base / "run", base / "reference", dtype="fp32")
    return Trained(base / "run", base / "assets", reference)


@dataclass
class Place:
    project: Path
    checkpoints: Path  # host path of the target's checkpoints folder
    assets_at: str  # the demo assets' path as the place sees it
    socket: str
    kind: str


def train_tables(assets_at: str) -> str:
    raw = {k: dict(v) for k, v in TRAIN.items()}
    raw["demo"]["folder"] = assets_at
    lines = []
    for name, values in raw.items():
        lines.append(f"[train.{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


@pytest.fixture(params=["local", "ssh", "proxmox"])
def place(request: pytest.FixtureRequest, tmp_path: Path, trained: Trained) -> Iterator[Place]:
    project = tmp_path / "project"
    project.mkdir()
    shutil.copytree(
        REPO / "trainer", project / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    python = json.dumps(sys.executable)
    if request.param == "local":
        target, ckpt, assets = "", project / ".dflash" / "local" / "checkpoints", trained.assets
        assets_at = str(assets)
    elif request.param == "ssh":
        request.getfixturevalue("ssh_home")
        root, ckpt = tmp_path / "remote-root", tmp_path / "remote-ckpt"
        target = (
            f'[target]\nplace = "ssh"\nhost = "testbox"\nroot = "{root}"\n'
            f'checkpoints = "{ckpt}"\npython = {python}\n'
        )
        assets_at = str(trained.assets)
    else:
        proxmox = request.getfixturevalue("proxmox")
        proxmox.create(CT)
        lend_python(proxmox, CT)
        _, ckpt = container_defaults(proxmox, CT, project)
        shutil.copytree(trained.assets, proxmox.workspace_dir(CT) / "assets")
        target = (
            f'[target]\nplace = "proxmox"\nhost = "{proxmox.alias}"\nct = {CT}\npython = {python}\n'
        )
        assets_at = "/workspace/assets"
    (project / "deploy.toml").write_text(
        f'{target}\n[job]\nsocket = "{socket}"\ncommand = "true"\nstop_timeout = 3\n\n'
        + train_tables(assets_at)
    )
    deployed = dflash(project, "deploy")
    assert deployed.returncode == 0, deployed.stderr
    shutil.copytree(trained.run / "step-00000002", ckpt / "step-00000002")
    yield Place(project, ckpt, assets_at, socket, request.param)
    if request.param != "proxmox":
        kill_tmux_server(socket)


def same_folder(a: Path, b: Path) -> bool:
    names = ["config.json", "model.safetensors"]
    match, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return sorted(os.listdir(a)) == sorted(os.listdir(b)) == names and match == names


def test_export_streams_the_folder_back(place: Place, trained: Trained, tmp_path: Path) -> None:
    to = tmp_path / "here" / "drafter"
    result = dflash(place.project, "export", "--to", str(to), "--dtype", "fp32", timeout=180)
    assert result.returncode == 0, result.stderr
    assert same_folder(to, trained.reference)
    assert "Exported to" in result.stderr and "MB/s" in result.stderr
    spec = {"method": "dflash", "model": str(to), "num_speculative_tokens": 3}  # B = 4
    assert f"vLLM: vllm serve TARGET --speculative-config '{json.dumps(spec)}'" in result.stderr
    assert f"--speculative-draft-model-path {to} --speculative-num-draft-tokens 4" in result.stderr
    left = {p.name for p in place.checkpoints.iterdir()} - {"train_stdout.log", "archive"}
    assert left == {"step-00000002"}  # no temporary folder left at the place
    assert list(to.parent.iterdir()) == [to]  # no staging folder left here


def test_keep_remote_and_errors(place: Place, trained: Trained, tmp_path: Path) -> None:
    if place.kind != "local":
        pytest.skip("--keep-remote and the errors do not depend on the place")
    to = tmp_path / "kept"
    kept = dflash(place.project, "export", "--to", str(to), "--checkpoint", "step-00000002",
                  "--dtype", "fp32", "--keep-remote", timeout=180)  # fmt: skip
    assert kept.returncode == 0, kept.stderr
    (copy,) = (place.checkpoints / "exports").iterdir()
    assert copy.name.startswith("step-00000002-") and f"exports/{copy.name}" in kept.stderr
    assert same_folder(copy, trained.reference) and same_folder(to, trained.reference)

    again = dflash(place.project, "export", "--to", str(to))
    assert again.returncode == 1 and "exists" in again.stderr and "hint:" in again.stderr
    missing = dflash(place.project, "export", "--to", str(tmp_path / "x"),
                     "--checkpoint", "step-99999999")  # fmt: skip
    assert missing.returncode == 1 and "dflash checkpoints" in missing.stderr
    assert not (tmp_path / "x").exists()
    empty = dflash(place.project, "export", "--to", str(tmp_path / "y"),
                   "--checkpoint", str(place.checkpoints / "exports"))  # fmt: skip
    assert empty.returncode == 1 and "No checkpoint in" in empty.stderr
    torn = place.checkpoints / "step-00000009"
    shutil.copytree(place.checkpoints / "step-00000002", torn)
    (torn / "state.pt").write_bytes((torn / "state.pt").read_bytes()[:-8])
    refused = dflash(place.project, "export", "--to", str(tmp_path / "y"),
                     "--checkpoint", torn.name, timeout=180)  # fmt: skip
    assert refused.returncode == 1 and "exporter failed (exit 2)" in refused.stderr
    assert "checksum mismatch" in refused.stderr and not (tmp_path / "y").exists()
    assert "hint: Fix what it names" in refused.stderr and "--help" not in refused.stderr
    assert not list(tmp_path.glob(".*.tmp-*"))


def test_an_export_killed_midway_leaves_nothing(tmp_path: Path, trained: Trained) -> None:
    project = tmp_path / "project"
    project.mkdir()
    shutil.copytree(
        REPO / "trainer", project / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    (project / "deploy.toml").write_text(
        f'[job]\nsocket = "{socket}"\ncommand = "true"\n\n' + train_tables(str(trained.assets))
    )
    try:
        assert dflash(project, "deploy").returncode == 0
        ckpt = project / ".dflash" / "local" / "checkpoints"
        shutil.copytree(trained.run / "step-00000002", ckpt / "step-00000002")
        for sig in (signal.SIGINT, signal.SIGKILL):
            to = tmp_path / f"out-{sig.name}"
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            proc = subprocess.Popen(
                [sys.executable, "-m", "dflash_ops", "export", "--to", str(to)],
                cwd=project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                preexec_fn=default_sigint,
            )  # fmt: skip
            end = time.monotonic() + 60
            while not any(ckpt.glob(".export-*")) and time.monotonic() < end:
                time.sleep(0.05)  # the exporter runs at the place: the export is under way
            proc.send_signal(sig)
            proc.communicate(timeout=60)
            assert not to.exists()
            if sig == signal.SIGINT:
                assert proc.returncode == 130 and not list(tmp_path.glob(f".{to.name}.tmp-*"))
        end = time.monotonic() + 30  # the place's own temporary folder goes too
        while any(ckpt.glob(".export-*")) and time.monotonic() < end:
            time.sleep(0.2)
        assert not any(ckpt.glob(".export-*"))
    finally:
        kill_tmux_server(socket)


def test_at_a_terminal_the_export_says_what_it_waits_for(place: Place, tmp_path: Path) -> None:
    """While the exporter runs at the place nothing flows: the progress line says so, instead
    of `0/? bytes` at `0.0 MB/s`."""
    if place.kind != "local":
        pytest.skip("the progress line is drawn here, whatever the place")
    to = tmp_path / "drafter"
    argv = [sys.executable, "-m", "dflash_ops", "export", "--to", str(to)]
    term = Terminal(argv, cwd=place.project, env={"PYTHONPATH": str(REPO)})
    try:
        term.read_until("exporting at the place", timeout=120)
        code = term.wait(timeout=180)
    finally:
        term.close()
    assert code == 0, term.text
    assert "0/?" not in term.text and "0.0 bytes/s" not in term.text, term.text
    assert "s at the place, then" in term.text and to.is_dir()
