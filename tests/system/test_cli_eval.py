"""`dflash eval` end to end: a tiny demo run deployed on this machine, then evaluated at the place
through the CLI (and once through the loopback SSH host), plus its error cases."""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cli_helpers import REPO, dflash, kill_tmux_server

BLOCK = 4
# The smallest demo that still trains: 8 samples from a 2-layer target, 20 steps, 2 checkpoints.
TRAIN = f"""
[train]
demo = {{ enabled = true, num_samples = 8, num_layers = 2, prompt_len = 6, gen_len = 18 }}
model = {{ num_layers = 1, block_size = {BLOCK}, num_target_layers = 2 }}
data = {{ batch_size = 8, num_anchors = 8, bucket = 32, max_len = 32, noise = 0.0 }}
optim = {{ lr = 1e-2, warmup_steps = 5, weight_decay = 0.0 }}
run = {{ steps = 20, checkpoint_every = 10, device = "cpu", threads = 1, log_every = 10 }}
"""


@dataclass
class Deployed:
    project: Path
    root: Path
    checkpoints: Path
    prompts: Path  # two demo samples, written at the place
    socket: str


def write_config(project: Path, socket: str, extra: str = "") -> None:
    (project / "deploy.toml").write_text(
        f'{extra}\n[job]\nsocket = "{socket}"\nstop_timeout = 3\n{TRAIN}'
    )


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployed]:
    project = tmp_path_factory.mktemp("eval-project")
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    write_config(project, socket)
    shutil.copytree(
        REPO / "trainer", project / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    try:
        result = dflash(project, "deploy")
        assert result.returncode == 0, result.stderr
        followed = dflash(project, "logs", "--follow", timeout=300)
        assert followed.returncode == 0, followed.stdout[-2000:]
        root = project / ".dflash" / "local"
        checkpoints = root / "checkpoints"
        lines = (root / "demo-assets" / "train.jsonl").read_text().splitlines()[:2]
        prompts = project / "prompts.jsonl"
        prompts.write_text("\n".join(lines) + "\n")
        yield Deployed(project, root, checkpoints, prompts, socket)
    finally:
        kill_tmux_server(socket)


def check_report(stdout: str) -> dict:
    report = json.loads(stdout)
    assert report["tau"] >= 1.0
    assert report["lossless_checked"] is True
    assert len(report["slot_acceptance"]) == report["block_size"] - 1 == BLOCK - 1
    assert len(report["slot_accuracy"]) == BLOCK - 1  # at every output position
    assert report["prompts"] == 2
    lookup = report["baselines"]["prompt_lookup"]  # on by default, on the same prompts
    assert lookup["prompts"] == 2 and lookup["new_tokens"] == report["new_tokens"]
    assert lookup["tau"] >= 1.0 and lookup["lossless_checked"] is True
    return report


def test_eval_json_on_the_newest_and_a_named_checkpoint(deployed: Deployed) -> None:
    names = sorted(p.name for p in deployed.checkpoints.glob("step-*"))
    assert len(names) == 2, names
    newest = dflash(
        deployed.project, "eval", "--prompts", str(deployed.prompts),
        "--max-new-tokens", "8", "--json",
    )  # fmt: skip
    assert newest.returncode == 0, newest.stderr
    report = check_report(newest.stdout)
    assert report["new_tokens"] == 2 * 8

    named = dflash(
        deployed.project, "eval", "--prompts", str(deployed.prompts),
        "--checkpoint", names[0], "--max-new-tokens", "8", "--limit", "1",
    )  # fmt: skip
    assert named.returncode == 0, named.stderr
    lines = named.stdout.splitlines()
    assert lines[:2] == [
        f"evaluating step {int(names[0][5:])} on 1 prompts",
        "prompt 1/1 done: tau so far " + lines[1].rsplit(" ", 1)[1],
    ]
    drafter, lookup, versus = lines[2:]
    assert drafter.startswith("drafter        tau ") and drafter.endswith("| lossless")
    assert "1 prompts, B=4" in drafter
    assert lookup.startswith("prompt lookup  tau ") and lookup.endswith("| lossless")
    assert "vs" in versus

    alone = dflash(
        deployed.project, "eval", "--prompts", str(deployed.prompts),
        "--max-new-tokens", "8", "--baseline", "none", "--json",
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr
    assert json.loads(alone.stdout)["baselines"] == {}


def test_eval_errors(deployed: Deployed, tmp_path: Path) -> None:
    missing = dflash(deployed.project, "eval", "--prompts", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 1
    assert "prompts file" in missing.stderr and "does not exist" in missing.stderr
    assert "hint:" in missing.stderr

    no_step = dflash(
        deployed.project, "eval", "--prompts", str(deployed.prompts),
        "--checkpoint", "step-99999999",
    )  # fmt: skip
    assert no_step.returncode == 1 and "dflash checkpoints" in no_step.stderr

    relative = dflash(deployed.project, "eval", "--prompts", "missing.jsonl")  # local: from here
    assert (
        relative.returncode == 1 and f"{deployed.project}/missing.jsonl does not" in relative.stderr
    )
    outside = dflash(
        deployed.project, "eval", "--prompts", str(deployed.prompts), "--checkpoint", "../x"
    )
    assert outside.returncode == 1 and "absolute" in outside.stderr

    broken = tmp_path / "broken.jsonl"
    broken.write_text("this is not json\n")
    failed = dflash(deployed.project, "eval", "--prompts", str(broken))
    assert failed.returncode == 2, failed.stderr
    assert "evaluator failed" in failed.stderr and "(exit 2)" in failed.stderr
    assert "error:" in failed.stderr and failed.stdout == ""


def test_eval_without_a_release(tmp_path: Path) -> None:
    write_config(tmp_path, f"dft-{uuid.uuid4().hex[:10]}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("{}\n")
    result = dflash(tmp_path, "eval", "--prompts", str(prompts))
    assert result.returncode == 1
    assert "Nothing is deployed" in result.stderr and "Deploy first" in result.stderr


def test_eval_over_ssh(deployed: Deployed, ssh_home: object, tmp_path: Path) -> None:
    """The same deployment seen through the loopback SSH host."""
    box = (
        f'[targets.box]\nplace = "ssh"\nhost = "elsewhere"\nroot = "{deployed.root}"\n'
        f'checkpoints = "{deployed.checkpoints}"\npython = "{sys.executable}"\n'
    )
    write_config(tmp_path, deployed.socket, box)
    newest = max(deployed.checkpoints.glob("step-*"))  # an absolute path at the place
    result = dflash(
        tmp_path, "eval", "--target", "box", "--host", "testbox", "--checkpoint", str(newest),
        "--prompts", str(deployed.prompts), "--max-new-tokens", "8", "--json",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    check_report(result.stdout)
    relative = dflash(
        tmp_path, "eval", "--target", "box", "--host", "testbox", "--prompts", "prompts.jsonl"
    )
    assert relative.returncode == 1 and "relative path" in relative.stderr
    assert "hint: Pass the file's absolute path there" in relative.stderr


def test_eval_streams_progress_as_it_goes(deployed: Deployed, tmp_path: Path) -> None:
    """Each batch's line arrives while the evaluator still works on the next ones (one prompt
    a batch here: `--batch-tokens 1`)."""
    import os
    import subprocess

    lines = (deployed.root / "demo-assets" / "train.jsonl").read_text().splitlines()[:6]
    prompts = tmp_path / "six.jsonl"
    prompts.write_text("\n".join(lines) + "\n")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_ops", "eval", "--prompts", str(prompts),
         "--max-new-tokens", "48", "--batch-tokens", "1"],
        cwd=deployed.project, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("evaluating step 20 on 6 prompts")
        assert proc.stdout.readline().startswith("prompt 1/6 done: tau so far ")
        assert proc.poll() is None  # five prompts (and their lossless checks) still to go
        rest = proc.stdout.read().splitlines()
    finally:
        proc.wait(timeout=120)
    assert [x.split(":")[0] for x in rest[:5]] == [f"prompt {i}/6 done" for i in range(2, 7)]
    assert rest[5].startswith("drafter        tau ") and proc.returncode == 0


def test_eval_of_an_archived_run_writes_nothing_into_archive(deployed: Deployed) -> None:
    """The demo assets of an archived run are the training's, beside the checkpoints folder:
    `archive/` keeps holding runs only, and a prune afterwards loses none."""
    run = deployed.checkpoints / "archive" / "20260101T000000.000Z"
    step = min(deployed.checkpoints.glob("step-*"))
    shutil.copytree(step, run / step.name)
    try:
        result = dflash(
            deployed.project, "eval", "--prompts", str(deployed.prompts),
            "--checkpoint", str(run / step.name), "--max-new-tokens", "8", "--limit", "1",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert [p.name for p in (deployed.checkpoints / "archive").iterdir()] == [run.name]
        pruned = dflash(deployed.project, "checkpoints", "prune", "--keep", "1")
        assert pruned.returncode == 0 and (run / step.name).is_dir(), pruned.stderr
    finally:
        shutil.rmtree(deployed.checkpoints / "archive")


def test_after_a_fresh_deploy_eval_and_export_name_the_archived_run(
    deployed: Deployed, tmp_path: Path
) -> None:
    """The reported case: after a plain redeploy the checkpoints are archived, and eval and
    export found none, pointing at `python -m trainer export --help at the place`. They say
    where the run went, and `--checkpoint <its UTC time>` takes it; the demo's held-out prompts
    need no --prompts."""
    project = tmp_path / "project"
    local = project / ".dflash" / "local"
    shutil.copytree(
        deployed.checkpoints, local / "checkpoints", ignore=shutil.ignore_patterns("archive")
    )
    shutil.copytree(deployed.root / "demo-assets", local / "demo-assets")
    shutil.copytree(
        REPO / "trainer", project / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    write_config(project, socket, "")
    text = (project / "deploy.toml").read_text()
    (project / "deploy.toml").write_text(text.replace("[job]\n", '[job]\ncommand = "true"\n'))
    try:
        redeployed = dflash(project, "deploy")
        assert redeployed.returncode == 0, redeployed.stderr
        (stamp,) = [p.name for p in (local / "checkpoints" / "archive").iterdir()]
        for args in (["eval"], ["export", "--to", str(tmp_path / "drafter")]):
            result = dflash(project, *args)
            assert result.returncode == 1, result.stderr
            assert f"No checkpoint in {local / 'checkpoints'}" in result.stderr
            assert "archives the run that trained" in result.stderr
            assert f"hint: Take the newest archived run's: --checkpoint {stamp}" in result.stderr
            assert "--help at the place" not in result.stderr

        evaluated = dflash(
            project, "eval", "--checkpoint", stamp, "--max-new-tokens", "8", "--limit", "3",
            "--json",
        )  # fmt: skip
        assert evaluated.returncode == 0, evaluated.stderr
        assert json.loads(evaluated.stdout)["prompts"] == 3  # the demo's held-out prompts
        exported = dflash(project, "export", "--checkpoint", stamp, "--to", str(tmp_path / "d"))
        assert exported.returncode == 0, exported.stderr
        assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [
            "config.json", "model.safetensors",
        ]  # fmt: skip
        step = sorted((local / "checkpoints" / "archive" / stamp).glob("step-*"))[0].name
        named = dflash(project, "eval", "--checkpoint", f"{stamp}/{step}", "--limit", "1")
        assert named.returncode == 0, named.stderr
        assert f"evaluating step {int(step[5:])} on 1 prompts" in named.stdout
        assert [p.name for p in (local / "checkpoints" / "archive").iterdir()] == [stamp]
    finally:
        kill_tmux_server(socket)
