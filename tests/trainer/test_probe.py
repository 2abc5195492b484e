"""The in-training τ probe: a drafter trained on four samples memorises them — τ on their prompts
rises, held-out τ stays at prompt lookup's — and the log, the metrics rows, TensorBoard and
`dflash status` say so; an untrained drafter, and the same drafter on fresh prompts, do not."""

from __future__ import annotations

import json
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tests.cli_helpers import dflash
from tests.trainer.test_evaluate_train import BLOCK, make_config
from trainer.evaluation.report import EvalReport
from trainer.model.drafter import Drafter
from trainer.run.curves import TrainingCurves, available
from trainer.run.probe import MEMORISING, MemorisationRule, ProbeReport, TauProbe, spread
from trainer.run.trainer import Trainer
from trainer.settings.config import TrainConfigError
from trainer.settings.loading import config_from_dict

STEPS = 40
# 8 demo samples from a 2-layer random target: 4 trained on (10 epochs), 4 held out
SETTINGS = {
    "data": {"holdout": 4, "batch_size": 4},
    "optim": {"warmup_steps": 5},
    "run": {"steps": STEPS, "log_every": 10},
}
EVAL = {"every": 20, "num_prompts": 4, "train_prompts": 4, "max_new_tokens": 24}


def config(assets: Path, **eval_settings: object):
    return config_from_dict(make_config(assets, **SETTINGS, eval={**EVAL, **eval_settings}))


@dataclass
class Run:
    trainer: Trainer
    lines: list[str]
    rows: list[dict]
    out: Path


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("demo-assets")


@pytest.fixture(scope="module")
def memorised(assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """40 steps on 4 samples (10 epochs), probed at steps 20 and 40, into the checkpoints
    folder of a local place (for `dflash status`)."""
    project = tmp_path_factory.mktemp("project")
    out = project / ".dflash" / "local" / "checkpoints"
    lines: list[str] = []
    trainer = Trainer(config(assets), out, emit=lines.append)
    trainer.run()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return Run(trainer, lines, rows, out)


def test_the_rule() -> None:
    rule = MemorisationRule(ratio=1.25, margin=0.5)
    assert rule.holds(1.52, 5.88, 1.42)  # the failure this catches, as measured on an H200
    assert not rule.holds(1.52, 1.80, 1.42)  # a gap of 18 %
    assert not rule.holds(3.10, 5.88, 1.42)  # far above prompt lookup: it generalises too
    assert rule.holds(1.10, 1.60, None)  # without a baseline, the gap alone
    assert not rule.holds(1.10, None, 1.0)  # training prompts not measured
    assert not MemorisationRule(ratio=0).holds(1.0, 9.0, 1.0)
    with pytest.raises(TrainConfigError, match="eval.memorise_ratio"):
        config(Path("/unused"), memorise_ratio=1.0)
    with pytest.raises(TrainConfigError, match="eval.baseline"):
        config(Path("/unused"), baseline="ngram")


def test_training_prompts_spread_over_the_samples(memorised: Run) -> None:
    probe = memorised.trainer.source.tau_probe
    assert probe is not None and len(probe.prompts) == 4 and len(probe.train_prompts) == 4
    trained = memorised.trainer.source.stream.samples
    assert len(trained) == 4
    assert spread(trained, 2) == [probe.train_prompts[0], probe.train_prompts[2]]
    assert spread(trained, 9) == probe.train_prompts  # no more than there are, each once
    assert not {tuple(p) for p in probe.prompts} & {tuple(p) for p in probe.train_prompts}


def test_memorising_is_logged_and_recorded(memorised: Run) -> None:
    warnings = [line for line in memorised.lines if line.startswith("warning:")]
    assert warnings and warnings[-1].startswith(f"warning: step {STEPS}: {MEMORISING} (tau ")
    probed = [r for r in memorised.rows if "tau" in r]
    assert [r["step"] for r in probed] == [20, 40]
    last = probed[-1]["probe"]
    assert last["step"] == STEPS and last["memorising"] is True
    assert last["tau"] == probed[-1]["tau"]
    assert last["tau_train"] > 1.25 * last["tau"], last
    assert last["tau"] < last["tau_prompt_lookup"] + 0.5, last
    step_line = next(x for x in memorised.lines if x.startswith(f"step {STEPS}/"))
    lo, hi = last["tau_interval"]
    assert (
        f"| tau {last['tau']:.2f} (95% {lo:.2f}–{hi:.2f}; train {last['tau_train']:.2f}, "
        f"lookup {last['tau_prompt_lookup']:.2f}) |" in step_line
    )
    # rows between probes carry the latest probe, so the last row always has it
    assert memorised.rows[2]["step"] == 30 and memorised.rows[2]["probe"]["step"] == 20
    assert "tau" not in memorised.rows[2]


def test_a_fresh_drafter_and_fresh_prompts_do_not_warn(memorised: Run) -> None:
    trainer = memorised.trainer
    probe = trainer.source.tau_probe
    assert probe is not None
    torch.manual_seed(1)
    fresh = Drafter(trainer.drafter_worker.drafter.shape)
    report = probe(fresh, step=0)
    assert not report.memorising and report.warning is None
    assert report.train is not None and report.train.tau < 1.25 * report.held_out.tau

    # the memorised drafter, its "training prompts" swapped for prompts it never saw
    gen = torch.Generator().manual_seed(7)
    unseen = torch.randint(0, 256, (4, 6), generator=gen).tolist()
    control = TauProbe(
        probe.target,
        probe.prompts,
        max_new_tokens=probe.max_new_tokens,
        train_prompts=unseen,
        baseline=probe.baseline,
    )
    report = control(trainer.drafter_worker.drafter, step=STEPS)
    assert not report.memorising, (report.held_out.tau, report.train and report.train.tau)


def test_status_shows_the_probe_and_the_warning(memorised: Run) -> None:
    project = memorised.out.parents[2]
    socket = f"dft-{uuid.uuid4().hex[:10]}"
    (project / "deploy.toml").write_text(f'[job]\nsocket = "{socket}"\n\n[train]\ndemo = true\n')
    result = dflash(project, "status", "--json")
    assert result.returncode == 0, result.stderr
    probe = json.loads(result.stdout)["metrics"]["probe"]
    assert probe["memorising"] is True and probe["warning"].startswith(MEMORISING)
    human = dflash(project, "status")
    assert human.returncode == 0, human.stderr
    tau = next(line for line in human.stdout.splitlines() if line.startswith("tau"))
    lo, hi = probe["tau_interval"]
    assert f"{probe['tau']:.2f} (95% {lo:.2f}–{hi:.2f}) held out" in tau and f"step {STEPS}" in tau
    assert f"{probe['tau_train']:.2f} on training prompts" in tau
    assert f"prompt lookup {probe['tau_prompt_lookup']:.2f}" in tau
    assert any(line.startswith(f"warning  {MEMORISING}") for line in human.stdout.splitlines())


# ---- TensorBoard ------------------------------------------------------------------------------


def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


needs_tensorboard = pytest.mark.skipif(not available(), reason="tensorboard is not installed")


@needs_tensorboard
def test_tensorboard_curves_of_the_run(memorised: Run) -> None:
    curves = scalars(memorised.out / "tensorboard")
    steps = [r["step"] for r in memorised.rows]
    for tag in ("loss/total", "throughput/tokens_per_s", "accuracy/slot_1", "optim/lr"):
        assert [s for s, _ in curves[tag]] == steps, tag
    loss = [v for _, v in curves["loss/total"]]
    assert loss == pytest.approx([r["loss"] for r in memorised.rows], rel=1e-6)
    assert len([t for t in curves if t.startswith("accuracy/slot_")]) == BLOCK - 1
    probed = [r for r in memorised.rows if "tau" in r]
    for tag, key in [
        ("tau/held_out", "tau"),
        ("tau/train_prompts", "tau_train"),
        ("tau/prompt_lookup", "tau_prompt_lookup"),
    ]:
        want = [(r["step"], pytest.approx(r["probe"][key], rel=1e-6)) for r in probed]
        assert curves[tag] == want, tag
    # the probe's accuracy at every held-out position, beside the training accuracy's curves
    want = [(r["step"], pytest.approx(r["held_out_slot_accuracy"][0], rel=1e-6)) for r in probed]
    assert curves["held_out_accuracy/slot_1"] == want


@needs_tensorboard
def test_a_resumed_run_redraws_the_steps_after_its_checkpoint(tmp_path: Path) -> None:
    first = TrainingCurves(tmp_path)
    for step in (1, 2, 3, 4):
        first.write({"step": step, "loss": float(step)})
    first.close()
    again = TrainingCurves(tmp_path, start=2)  # resumed from step 2: steps 3, 4 come again
    for step in (3, 4):
        again.write({"step": step, "loss": 10.0 * step})
    again.close()
    assert scalars(tmp_path / "tensorboard")["loss/total"] == [
        (1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0),
    ]  # fmt: skip


@needs_tensorboard
def test_a_resumed_run_hides_what_it_does_not_draw_again(tmp_path: Path) -> None:
    """Resumed from step 2 with rows every second step: step 3 of the killed start is not
    drawn again, and is gone as metrics.jsonl's row of it is (one series)."""
    first = TrainingCurves(tmp_path)
    for step in (1, 2, 3):
        first.write({"step": step, "loss": float(step)})
    first.close()
    again = TrainingCurves(tmp_path, start=2)
    again.write({"step": 4, "loss": 40.0})
    again.close()
    assert scalars(tmp_path / "tensorboard")["loss/total"] == [(1, 1.0), (2, 2.0), (4, 40.0)]


def test_no_tensorboard_no_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard.summary.writer.record_writer", None)  # no import
    assert not available()
    curves = TrainingCurves(tmp_path)
    curves.write({"step": 1, "loss": 1.0})
    assert not (tmp_path / "tensorboard").exists()
    TrainingCurves(tmp_path / "off", enabled=False).write({"step": 1, "loss": 1.0})
    assert not (tmp_path / "off").exists()


@pytest.mark.parametrize(
    ("interval", "train", "lookup", "fields"),
    [
        ((1.31, 1.8), 5.88, 1.42, " | tau 1.52 (95% 1.31–1.80; train 5.88, lookup 1.42)"),
        ((1.31, 1.8), None, None, " | tau 1.52 (95% 1.31–1.80)"),
        (None, None, 1.42, " | tau 1.52 (lookup 1.42)"),
        (None, None, None, " | tau 1.52"),
    ],
)
def test_the_log_line_shows_the_interval_when_there_is_one(interval, train, lookup, fields) -> None:
    def report(tau: float, spread=None) -> EvalReport:
        return EvalReport(tau, [0.5], 2, 4, 40, 26, 30, 40, 1.33, True, tau_interval=spread)

    probe = ProbeReport(
        3000,
        report(1.52, interval),
        None if train is None else report(train),
        None if lookup is None else report(lookup),
        memorising=False,
    )
    assert probe.log_fields() == fields
