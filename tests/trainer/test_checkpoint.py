"""Checkpoints: atomic layout, torn temp folders ignored, checksum mismatch skipped with its
reason, other model/data settings refused naming the keys, keep-last pruning."""

from __future__ import annotations

import json
import resource
import signal

import pytest
import torch

from trainer.model import checkpoint as ckpt
from trainer.model.drafter import DRAFTER_FORMAT
from trainer.settings.loading import config_from_dict, with_overrides

CFG = config_from_dict({"model": {"target": "/m/t"}, "data": {"path": "/d/x.jsonl"}})


def state(step: int) -> dict:
    return {"step": step, "w": torch.full((3,), float(step))}


def test_save_find_load_and_prune(tmp_path) -> None:
    for step in (10, 20, 30, 40):
        ckpt.save_checkpoint(tmp_path, step, state(step), CFG, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(tmp_path)] == [30, 40]
    found = ckpt.find_resumable(tmp_path)
    assert found.path == tmp_path / "step-00000040" and found.skipped == []
    manifest = found.manifest
    assert manifest.step == 40 and manifest.config_hash == CFG.model_data_hash()
    assert manifest.code_version and len(manifest.sha256) == 64
    assert torch.equal(ckpt.load_state(found.path)["w"], torch.full((3,), 40.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def test_torn_temp_dir_is_ignored(tmp_path) -> None:
    ckpt.save_checkpoint(tmp_path, 5, state(5), CFG, keep_last=3)
    torn = tmp_path / ".tmp-step-00000010-999"
    torn.mkdir()
    (torn / "state.pt").write_bytes(b"half a file")
    found = ckpt.find_resumable(tmp_path)
    assert found.path == tmp_path / "step-00000005" and found.skipped == []
    assert ckpt.remove_stale_temps(tmp_path) == [torn] and not torn.exists()
    assert ckpt.find_resumable(tmp_path).path == tmp_path / "step-00000005"


def test_corrupt_and_incomplete_are_skipped_with_reason(tmp_path) -> None:
    for step in (1, 2, 3):
        ckpt.save_checkpoint(tmp_path, step, state(step), CFG, keep_last=5)
    with open(tmp_path / "step-00000003" / "state.pt", "r+b") as fh:
        fh.seek(-2, 2)
        fh.write(b"\x00\x01")
    (tmp_path / "step-00000002" / "manifest.json").unlink()
    found = ckpt.find_resumable(tmp_path)
    assert found.path == tmp_path / "step-00000001"
    reasons = {p.name: why for p, why in found.skipped}
    assert "checksum mismatch" in reasons["step-00000003"]
    assert reasons["step-00000002"] == "no manifest"
    bad = tmp_path / "step-00000001" / "manifest.json"
    bad.write_text("{not json")
    assert (
        "unreadable manifest"
        in dict((p.name, w) for p, w in ckpt.find_resumable(tmp_path).skipped)["step-00000001"]
    )


def test_other_settings_refused_naming_keys(tmp_path) -> None:
    ckpt.save_checkpoint(tmp_path, 7, state(7), CFG, keep_last=2)
    found = ckpt.find_resumable(tmp_path)
    assert ckpt.check_compatible(found, with_overrides(CFG, optim={"lr": 1.0})) == []
    other = with_overrides(CFG, model={"block_size": 8}, data={"num_anchors": 3})
    with pytest.raises(ckpt.CheckpointMismatch) as err:
        ckpt.check_compatible(found, other)
    assert err.value.keys == ["data.num_anchors", "model.block_size"]
    assert "model.block_size" in str(err.value) and "--force-resume" in str(err.value)
    assert ckpt.check_compatible(found, other, force=True) == [
        "data.num_anchors",
        "model.block_size",
    ]


def test_manifest_records_the_drafter_format_and_a_format_1_window_is_refused(tmp_path) -> None:
    windowed = with_overrides(CFG, model={"sliding_window": 8, "sliding_layers": [0]})
    ckpt.save_checkpoint(tmp_path, 3, state(3), windowed, keep_last=2)
    found = ckpt.find_resumable(tmp_path)
    assert found.manifest.drafter_format == DRAFTER_FORMAT
    assert ckpt.check_compatible(found, windowed) == []
    manifest = tmp_path / "step-00000003" / "manifest.json"
    raw = json.loads(manifest.read_text())
    raw.pop("drafter_format")  # as an earlier trainer wrote it
    manifest.write_text(json.dumps(raw))
    old = ckpt.find_resumable(tmp_path)
    assert old.manifest.drafter_format == 1
    with pytest.raises(ckpt.CheckpointMismatch, match="the window rule changed"):
        ckpt.check_compatible(old, windowed)
    ckpt.save_checkpoint(tmp_path / "full", 3, state(3), CFG, keep_last=2)
    manifest = tmp_path / "full" / "step-00000003" / "manifest.json"
    raw = json.loads(manifest.read_text())
    raw.pop("drafter_format")
    manifest.write_text(json.dumps(raw))
    assert ckpt.check_compatible(ckpt.find_resumable(tmp_path / "full"), CFG) == []


def test_write_failure_leaves_previous_intact(tmp_path) -> None:
    ckpt.save_checkpoint(tmp_path, 1, state(1), CFG, keep_last=2)
    # a real "file too large" from the kernel (RLIMIT_FSIZE with SIGXFSZ ignored) stands in for
    # a full disk: write() fails with an OSError part-way through state.pt
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, old_limit[1]))
    try:
        with pytest.raises(ckpt.CheckpointWriteFailed, match="step 2"):
            ckpt.save_checkpoint(tmp_path, 2, {"w": torch.zeros(100_000)}, CFG, keep_last=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert ckpt.find_resumable(tmp_path).path == tmp_path / "step-00000001"
    assert json.loads((tmp_path / "step-00000001" / "manifest.json").read_text())["step"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


@pytest.mark.parametrize(
    "text", [b'{"step": 2, "sha', b"\xff\xfe not utf-8", b"[1, 2]", b'{"step": 2, "extra": 1}']
)
def test_a_torn_or_foreign_manifest_is_skipped_not_fatal(tmp_path, text: bytes) -> None:
    for step in (1, 2):
        ckpt.save_checkpoint(tmp_path, step, state(step), CFG, keep_last=5)
    (tmp_path / "step-00000002" / "manifest.json").write_bytes(text)
    found = ckpt.find_resumable(tmp_path)
    assert found.path == tmp_path / "step-00000001"
    assert "unreadable manifest" in dict((p.name, w) for p, w in found.skipped)["step-00000002"]


@pytest.mark.parametrize("name", ["step-00000001", "step-99999999", ".tmp-step-00000003-42"])
def test_a_symlink_named_like_a_checkpoint_is_left_alone_and_named(tmp_path, name: str) -> None:
    """A link the trainer did not make, pointing at a folder outside the run: never pruned,
    resumed from, removed or followed; `foreign` names it. Saving and pruning go on."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the trainer's")
    run = tmp_path / "run"
    run.mkdir()
    (run / name).symlink_to(elsewhere)
    assert ckpt.remove_stale_temps(run) == []
    for step in (2, 4, 6):
        ckpt.save_checkpoint(run, step, state(step), CFG, keep_last=2)
    assert [s for s, _ in ckpt.list_checkpoints(run)] == [4, 6]
    found = ckpt.find_resumable(run)
    assert found.path == run / "step-00000006" and found.skipped == []
    assert ckpt.foreign(run) == [(run / name, f"a symbolic link (to {elsewhere})")]
    assert (run / name).is_symlink() and (elsewhere / "keep.txt").read_text() == "not the trainer's"


def test_files_named_like_checkpoints_are_foreign(tmp_path) -> None:
    (tmp_path / "step-00000005").write_text("a file")
    (tmp_path / ".tmp-step-00000001-7").write_text("a file")
    (tmp_path / "step-last").mkdir()
    ckpt.save_checkpoint(tmp_path, 1, state(1), CFG, keep_last=1)
    assert ckpt.remove_stale_temps(tmp_path) == []
    assert ckpt.find_resumable(tmp_path).path == tmp_path / "step-00000001"
    assert [(p.name, why) for p, why in ckpt.foreign(tmp_path)] == [
        (".tmp-step-00000001-7", "not a folder"),
        ("step-00000005", "not a folder"),
        ("step-last", "a folder not named step-NNNNNNNN"),
    ]


def test_a_link_where_the_checkpoint_goes_is_refused_naming_it(tmp_path) -> None:
    ckpt.save_checkpoint(tmp_path, 1, state(1), CFG, keep_last=3)
    (tmp_path / "step-00000002").symlink_to(tmp_path / "step-00000001")
    with pytest.raises(ckpt.CheckpointInTheWay, match="step-00000002 .*symbolic link") as caught:
        ckpt.save_checkpoint(tmp_path, 2, state(2), CFG, keep_last=3)
    assert "Move it out" in caught.value.hint
    assert (tmp_path / "step-00000002").is_symlink()
    assert ckpt.find_resumable(tmp_path).path == tmp_path / "step-00000001"
