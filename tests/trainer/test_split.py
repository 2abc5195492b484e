"""Split runs on the CPU: real torchrun, gloo, several processes, a tiny demo target.

Every batch produced is trained exactly once (global batch indices logged by both roles), drafter
parameters stay identical across drafter ranks, a 1 + 1 split repeats the colocated losses, a
SIGKILLed worker ends the job non-zero within bounded time naming the rank and its role, and no
process is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from trainer.settings.config import DemoConfig
from trainer.setup.demo import ensure_demo_assets
from trainer.split.segments import segments

ROOT = Path(__file__).resolve().parents[2]
DEMO = {"num_samples": 32, "num_layers": 4, "prompt_len": 6, "gen_len": 26}
TABLES = {
    "model": {"num_layers": 1, "block_size": 4, "num_target_layers": 2},
    "data": {"batch_size": 2, "num_anchors": 8, "bucket": 32, "max_len": 64, "noise": 0.01},
    "optim": {"lr": 3e-3, "warmup_steps": 2, "weight_decay": 0.0},
    "run": {"steps": 6, "device": "cpu", "checkpoint_every": 3, "threads": 1},
    "split": {"timeout_s": 120, "heartbeat_timeout_s": 20},
}


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("split-assets")
    ensure_demo_assets(folder, DemoConfig(enabled=True, **DEMO))
    return folder


def write_config(
    path: Path,
    assets: Path,
    *,
    data: dict[str, object] | None = None,
    evaluation: dict[str, object] | None = None,
    model: dict[str, object] | None = None,
    **run: object,
) -> Path:
    lines = ["[demo]", "enabled = true", f"folder = {json.dumps(str(assets))}"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in DEMO.items()]
    changes = {"run": run, "data": data or {}, "eval": evaluation or {}, "model": model or {}}
    for name, values in {**TABLES, "eval": {}}.items():
        values = {**values, **changes.get(name, {})}
        lines.append(f"[{name}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    config: Path, out: Path, *, procs: int, targets: int | None, extra_env: dict | None = None
) -> subprocess.Popen[str]:
    """`targets`: DFLASH_TARGET_GPUS, None leaves it unset (the trainer's default split)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(extra_env or {})}
    env.pop("DFLASH_TARGET_GPUS", None)
    if targets is not None:
        env["DFLASH_TARGET_GPUS"] = str(targets)
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(procs),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "-m",
        "trainer",
        "train",
        "--config",
        str(config),
        "--out",
        str(out),
    ]
    return subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )


def processes_with(marker: str) -> list[int]:
    """Pids whose command line mentions `marker` (a /proc scan, no psutil)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if marker.encode() in cmdline:
            pids.append(int(entry.name))
    return pids


def rank_pid(marker: str, rank: int) -> int | None:
    for pid in processes_with(marker):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"LOCAL_RANK=" + str(rank).encode() in env:
            return pid
    return None


def finish(proc: subprocess.Popen[str], timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{out[-4000:]}")
    return out


def run_split(
    tmp_path: Path,
    assets: Path,
    *,
    procs: int,
    targets: int | None,
    data: dict | None = None,
    evaluation: dict | None = None,
    model: dict | None = None,
    **run: object,
):
    out = tmp_path / f"run-{uuid.uuid4().hex[:8]}"
    cfg = write_config(
        tmp_path / "c.toml", assets, data=data, evaluation=evaluation, model=model, **run
    )
    proc = torchrun(cfg, out, procs=procs, targets=targets)
    log = finish(proc, 90)
    assert proc.returncode == 0, log[-4000:]
    assert processes_with(out.name) == [], "a worker outlived the job"
    ranks = [json.loads((out / "ranks" / f"rank-{r}.json").read_text()) for r in range(procs)]
    return out, log, ranks


def check_exactly_once(ranks: list[dict], expected: int) -> None:
    produced = [i for r in ranks if r["role"] == "target" for i in r["indices"]]
    trained = [i for r in ranks if r["role"] == "drafter" for i in r["indices"]]
    assert len(produced) == len(set(produced)) == expected, produced
    assert sorted(trained) == sorted(produced), (trained, produced)


def test_segments_cut_at_checkpoints() -> None:
    segs = segments(4, 11, 3)
    assert [(s.start, s.end) for s in segs] == [(4, 6), (6, 9), (9, 11)]
    assert [(s.start, s.end) for s in segments(0, 5, 0)] == [(0, 5)]


@pytest.mark.slow
def test_one_target_two_drafters(tmp_path, assets) -> None:
    out, log, ranks = run_split(tmp_path, assets, procs=3, targets=1)
    assert [r["role"] for r in ranks] == ["target", "drafter", "drafter"]
    check_exactly_once(ranks, expected=6 * 2)
    assert ranks[1]["batches"] == ranks[2]["batches"] == 6  # lock-step: one batch per step each
    assert ranks[1]["params_sha256"] == ranks[2]["params_sha256"]
    assert "rank 0 (target 0 of 1)" in log and "rank 2 (drafter 1 of 2)" in log
    assert "batches: produced 12, trained 12, expected 12" in log
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 7))
    last = rows[-1]
    assert [r["role"] for r in last["ranks"]] == ["target", "drafter", "drafter"]
    assert set(last["roles"]) == {"target", "drafter"} and last["roles"]["drafter"]["ranks"] == 2
    assert last["batches"] == {"produced": 12, "trained": 12}
    assert all(r["tokens_per_s"] >= 0 and 0 <= r["wait_frac"] <= 1 for r in last["ranks"])
    assert (out / "step-00000003").is_dir() and (out / "step-00000006").is_dir()


@pytest.mark.slow
def test_two_drafters_training_in_parts_match_one_part(tmp_path, assets) -> None:
    """`data.micro_batches = 2` under DDP: the drafters all-reduce once per step (after the
    second part) and train as with whole batches: the same losses, the same weights."""
    runs = {}
    for parts in (1, 2):
        out, _, ranks = run_split(
            tmp_path, assets, procs=3, targets=1, steps=4, checkpoint_every=0,
            data={"micro_batches": parts},
        )  # fmt: skip
        assert ranks[1]["params_sha256"] == ranks[2]["params_sha256"]
        rows = (out / "metrics.jsonl").read_text().splitlines()
        runs[parts] = [json.loads(line)["loss"] for line in rows]
    assert runs[2] == pytest.approx(runs[1], rel=1e-5, abs=0)


@pytest.mark.slow
def test_two_targets_one_drafter_and_resume(tmp_path, assets) -> None:
    """Two targets without `DFLASH_TARGET_GPUS`: the default split of the demo's shapes, which
    rank 0 says once (its target costs more per token than the drafter, so 2 + 1 of 3 where
    ⌊G/2⌋ would be 1 + 2; tests/trainer/test_split_shapes.py)."""
    out, log, ranks = run_split(
        tmp_path, assets, procs=3, targets=None, steps=4, checkpoint_every=2
    )
    assert log.count("default split 2 + 1 of 3 GPUs") == 1, log[-4000:]
    assert [r["role"] for r in ranks] == ["target", "target", "drafter"]
    check_exactly_once(ranks, expected=4)
    assert all(r["batches"] > 0 for r in ranks[:2]), "both targets should have produced"
    # resume the same run folder for 2 more steps: batches 4 and 5 follow, nothing repeats
    cfg = write_config(tmp_path / "c2.toml", assets, steps=6, checkpoint_every=2, extend=True)
    proc = torchrun(cfg, out, procs=3, targets=None)
    log2 = finish(proc, 90)
    assert proc.returncode == 0, log2[-4000:]
    assert "resumed from step-00000004" in log2
    ranks2 = [json.loads((out / "ranks" / f"rank-{r}.json").read_text()) for r in range(3)]
    assert sorted(i for r in ranks2 if r["role"] == "drafter" for i in r["indices"]) == [4, 5]


@pytest.mark.slow
def test_one_plus_one_repeats_colocated_losses(tmp_path, assets) -> None:
    from trainer.run.trainer import Trainer
    from trainer.settings.loading import load_config

    out, _, _ = run_split(tmp_path, assets, procs=2, targets=1, steps=4, checkpoint_every=0)
    split = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(write_config(tmp_path / "c3.toml", assets, steps=4, checkpoint_every=0))
    colocated = [r.loss for r in Trainer(cfg, tmp_path / "colo", emit=lambda _: None).run()]
    assert split == pytest.approx(colocated, rel=1e-6, abs=0)


@pytest.mark.slow
def test_a_drafter_started_from_target_layers_trains_as_colocated(tmp_path, assets) -> None:
    """`model.init_layers` in a split run: the drafter ranks, which never load the target, get
    the layers from target rank 0 and train exactly as a colocated run started the same way."""
    from trainer.run.trainer import Trainer
    from trainer.settings.loading import load_config

    start = {"init_layers": [3]}
    out, _, _ = run_split(
        tmp_path, assets, procs=2, targets=1, steps=3, checkpoint_every=0, model=start
    )
    split = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    def colocated(name: str, model: dict | None) -> list[float]:
        path = tmp_path / f"{name}.toml"
        cfg = write_config(path, assets, steps=3, checkpoint_every=0, model=model)
        return [r.loss for r in Trainer(load_config(cfg), tmp_path / name, emit=print).run()]

    assert split == pytest.approx(colocated("started", start), rel=1e-6, abs=0)
    assert split != pytest.approx(colocated("random", None), rel=1e-3)  # the start matters


@pytest.mark.slow
def test_killed_worker_stops_the_job_naming_it(tmp_path, assets) -> None:
    out = tmp_path / f"kill-{uuid.uuid4().hex[:8]}"
    cfg = write_config(tmp_path / "c.toml", assets, steps=100000, checkpoint_every=0)
    proc = torchrun(cfg, out, procs=3, targets=1)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 60
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "the run did not start"
        time.sleep(0.2)
    victim = rank_pid(out.name, 2)
    assert victim is not None
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    log = finish(proc, 40)
    took = time.monotonic() - killed
    assert proc.returncode != 0
    assert took < 30, took
    assert "rank 2 (drafter 1 of 2)" in log and "exited unexpectedly" in log, log[-4000:]
    deadline = time.monotonic() + 10
    while processes_with(out.name) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_with(out.name) == [], "a worker outlived the job"


@pytest.mark.slow
def test_the_split_run_says_when_data_starts_repeating(tmp_path, assets) -> None:
    from trainer.data.dataset import repeat_note

    # 32 samples in batches of 16: two batches per epoch, the third starts the second epoch
    _, log, _ = run_split(
        tmp_path, assets, procs=2, targets=1, data={"batch_size": 16}, steps=3, checkpoint_every=0
    )
    assert log.count("repeated samples") == 1 and repeat_note(1, 32) in log


@pytest.mark.slow
def test_the_split_run_keeps_the_holdout_out_of_training(tmp_path, assets) -> None:
    """`data.holdout` samples are never trained on, as in the colocated run: a 1 + 1 split
    repeats the colocated losses, and an epoch is the 24 samples left (batches of 12)."""
    from trainer.data.dataset import repeat_note
    from trainer.run.trainer import Trainer
    from trainer.settings.loading import load_config

    data = {"holdout": 8, "batch_size": 12}
    out, log, _ = run_split(
        tmp_path, assets, procs=2, targets=1, data=data, steps=3, checkpoint_every=0
    )
    assert repeat_note(1, 24) in log, log[-4000:]
    split = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    cfg = write_config(tmp_path / "c4.toml", assets, data=data, steps=3, checkpoint_every=0)
    trainer = Trainer(load_config(cfg), tmp_path / "colo", emit=lambda _: None)
    colocated = [r.loss for r in trainer.run()]
    assert split == pytest.approx(colocated, rel=1e-6, abs=0)


@pytest.mark.slow
def test_the_split_run_probes_held_out_tau_like_the_colocated_run(tmp_path, assets) -> None:
    """With `eval.every`, target rank 0 runs the τ probe of the drafter's weights at steps 2
    and 4 (mid-segment and at the end; a checkpoint at 3): the rows carry the same held-out,
    training-prompt and prompt-lookup τ as the colocated run's, the losses stay equal (the
    probe draws no random numbers), and an epoch is the 24 samples left by `data.holdout`."""
    from trainer.data.dataset import repeat_note
    from trainer.run.trainer import Trainer
    from trainer.settings.loading import load_config

    data = {"holdout": 8, "batch_size": 12}
    evaluation = {"every": 2, "num_prompts": 3, "train_prompts": 2, "max_new_tokens": 6}
    settings = {"data": data, "evaluation": evaluation, "steps": 4, "checkpoint_every": 3}
    out, log, _ = run_split(tmp_path, assets, procs=2, targets=1, **settings)
    assert repeat_note(1, 24) in log, log[-4000:]
    split = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(write_config(tmp_path / "c5.toml", assets, **settings))
    trainer = Trainer(cfg, tmp_path / "colo", emit=lambda _: None)
    losses = [r.loss for r in trainer.run()]
    colocated = [json.loads(line) for line in (tmp_path / "colo" / "metrics.jsonl").open()]
    assert [r["loss"] for r in split] == pytest.approx(losses, rel=1e-6, abs=0)
    for key in ("step", "tokens", "epochs"):  # the same rows, written once
        assert [r[key] for r in split] == pytest.approx([r[key] for r in colocated]), key
    for mine, theirs in zip(split, colocated, strict=True):
        assert mine["slot_accuracy"] == pytest.approx(theirs["slot_accuracy"], rel=1e-6)
    probed = [r for r in split if "tau" in r]
    assert [r["step"] for r in probed] == [2, 4] and "tau" not in split[2]
    for mine, theirs in zip(probed, [r for r in colocated if "tau" in r], strict=True):
        assert mine["probe"]["step"] == mine["step"] == theirs["step"]
        assert mine["tau"] >= 1.0 and mine["tau"] == pytest.approx(theirs["tau"], rel=1e-9)
        assert mine["slot_acceptance"] == pytest.approx(theirs["slot_acceptance"], rel=1e-9)
        assert mine["held_out_slot_accuracy"] == pytest.approx(
            theirs["held_out_slot_accuracy"], rel=1e-9
        )
        for key in ("tau_train", "tau_prompt_lookup"):
            assert mine["probe"][key] == pytest.approx(theirs["probe"][key], rel=1e-9)
    assert split[2]["probe"]["step"] == 2  # the latest probe, repeated on later rows
    assert "| tau " in log
