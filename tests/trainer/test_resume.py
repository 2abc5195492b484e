"""Honest resume bookkeeping: a changed lr schedule is refused unless `run.extend`, then applied
from the resumed step and logged; the manifest holds every value the run resolved."""

from __future__ import annotations

import json

import pytest

from tests.trainer.test_train import assets, tiny_config  # noqa: F401 (a fixture)
from trainer.model.checkpoint import RunFinished, ScheduleChanged, find_resumable
from trainer.run.pipeline import lr_at
from trainer.run.trainer import Trainer


def quiet(_: str) -> None:
    pass


def test_raised_steps_are_refused_without_extend(tmp_path, assets) -> None:  # noqa: F811
    out = tmp_path / "run"
    Trainer(tiny_config(assets, run={"steps": 4, "checkpoint_every": 2}), out, emit=quiet).run()
    with pytest.raises(ScheduleChanged) as caught:
        Trainer(tiny_config(assets, run={"steps": 8, "checkpoint_every": 2}), out, emit=quiet)
    assert "run.steps 4 → 8" in str(caught.value)
    assert "extend = true" in str(caught.value) and "dflash deploy --resume" in str(caught.value)


@pytest.mark.parametrize("new_lr", [None, 1e-3])
def test_extend_applies_the_new_schedule_from_the_resumed_step(tmp_path, assets, new_lr) -> None:  # noqa: F811
    out = tmp_path / "run"
    Trainer(tiny_config(assets, run={"steps": 4, "checkpoint_every": 2}), out, emit=quiet).run()
    optim = {"lr": new_lr} if new_lr else {}
    cfg = tiny_config(assets, run={"steps": 8, "checkpoint_every": 2, "extend": True}, optim=optim)
    lines: list[str] = []
    results = Trainer(cfg, out, emit=lines.append).run()
    expected = [cfg.optim.lr * lr_at(s, cfg.optim, 8) for s in range(4, 8)]
    assert [r.lr for r in results] == pytest.approx(expected, rel=1e-12)
    said = next(line for line in lines if line.startswith("schedule changed on resume"))
    assert "run.steps 4 → 8" in said and f"{expected[0]:.2e}" in said
    if new_lr:
        assert "optim.lr 0.003 → 0.001" in said


def test_a_finished_run_has_nothing_left(tmp_path, assets) -> None:  # noqa: F811
    cfg = tiny_config(assets, run={"steps": 2})
    Trainer(cfg, tmp_path / "run", emit=quiet).run()
    with pytest.raises(RunFinished, match="nothing left to do"):
        Trainer(cfg, tmp_path / "run", emit=quiet)


def test_manifest_stores_the_resolved_values(tmp_path, assets) -> None:  # noqa: F811
    cfg = tiny_config(assets, run={"steps": 2})
    assert cfg.model.target_layers is None and cfg.model.mask_token_id is None
    trainer = Trainer(cfg, tmp_path / "run", emit=quiet)
    trainer.run()
    found = find_resumable(tmp_path / "run")
    assert found.path is not None
    manifest = json.loads((found.path / "manifest.json").read_text())
    resolved = manifest["resolved"]
    assert resolved["model.target_layers"] == trainer.source.target.layers
    assert isinstance(resolved["model.mask_token_id"], int)
    assert resolved["model.mask_token_id"] == trainer.drafter_worker.drafter.shape.mask_token_id
    assert (
        resolved["loss.gamma"] == trainer.drafter_worker.gamma and resolved["run.device"] == "cpu"
    )
    assert resolved["data.batch_size"] == cfg.data.batch_size  # every other setting too
    assert manifest["schedule"] == cfg.schedule_settings()


def test_a_symlinked_step_beside_a_run_is_named_and_training_goes_on(tmp_path, assets) -> None:  # noqa: F811
    """Links named `step-*` and `.tmp-step-*` in the run folder: the run starts, checkpoints and
    prunes as if they were not there, and its log names each one once."""
    out, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    for name in ("step-00000000", "step-99999999", ".tmp-step-00000002-1"):
        (out / name).symlink_to(elsewhere)
    lines: list[str] = []
    cfg = tiny_config(assets, run={"steps": 4, "checkpoint_every": 1, "keep_last": 1})
    Trainer(cfg, out, emit=lines.append).run()
    assert find_resumable(out).path == out / "step-00000004"
    warned = [line for line in lines if "the trainer did not make" in line]
    assert len(warned) == 3 and all(str(elsewhere) in line for line in warned), warned
    assert all((out / n).is_symlink() for n in ("step-00000000", "step-99999999"))
