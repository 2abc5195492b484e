"""A drafter folder means the same to SpecForge's `DFlashDraftModel` as to ours
(`bench/peer_interop.check`, on the CPU, SpecForge installed in a private folder): this
project's exported folder (`trainer.export.folder`; a trained demo drafter with a sliding-window layer
and grouped key/value heads) loads into SpecForge's class key for key, strictly, and gives the
same block logits; a folder SpecForge's own `save_pretrained` writes loads into ours with the
same weights and logits; a folder with a tensor too many or too few is refused by both."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.trainer import test_export
from tests.trainer.peer_site import FETCH, install
from trainer.data.dataset import load_samples
from trainer.export.hf_format import load_folder, tensor_names
from trainer.run.trainer import Trainer

BOUND = 1e-5  # fp32 on both sides; the two implementations order a few reductions differently
run = test_export.run  # the trained demo drafter, and its exported folder
exported = test_export.exported


@pytest.fixture(scope="module")
def specforge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    site = install(tmp_path_factory.mktemp("peer-site"))
    if site is None:
        pytest.skip(FETCH)
    sys.path.append(str(site))  # after this interpreter's own packages: only what it lacks
    yield site
    sys.path.remove(str(site))


def inputs(trainer: Trainer) -> tuple[torch.Tensor, torch.Tensor]:
    """A training sample's first 32 tokens and four anchors in it."""
    ids = torch.tensor([load_samples(trainer.config.data.path)[0].input_ids[:32]])
    return ids, torch.tensor([[3, 9, 17, 25]])


def test_our_export_loads_into_specforge_key_for_key_with_the_same_logits(
    specforge, run, exported
) -> None:
    from bench.peer_interop import check

    trainer, _ = run
    drafter = trainer.drafter_worker.drafter
    assert drafter.shape.sliding_layers and drafter.shape.num_kv_heads < drafter.shape.num_heads
    row = check(exported, trainer.source.target, *inputs(trainer))
    assert row["missing_in_folder"] == [] and row["unknown_to_specforge"] == []
    assert row["tensors"] == len(tensor_names(drafter.shape))
    assert row["block_logits_max_rel_diff"] <= BOUND


def test_specforge_save_pretrained_loads_into_ours(specforge, run, exported, tmp_path) -> None:
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.training.model_loading import load_draft_config_source

    from bench.peer_interop import check

    trainer, _ = run
    torch.manual_seed(1)
    theirs = DFlashDraftModel(load_draft_config_source(str(exported / "config.json")))
    theirs.save_pretrained(str(tmp_path / "theirs"))  # its own initialisation, its own writer
    ours, _ = load_folder(tmp_path / "theirs")
    mine = ours.state_dict()
    assert set(mine) == set(theirs.state_dict())
    assert all(torch.equal(mine[k], v.float()) for k, v in theirs.state_dict().items())
    row = check(tmp_path / "theirs", trainer.source.target, *inputs(trainer))
    assert row["block_logits_max_rel_diff"] <= BOUND


def test_a_tensor_too_many_or_too_few_is_refused_by_both(specforge, run, exported, tmp_path):
    from safetensors.torch import load_file, save_file

    from bench.peer_interop import specforge_model
    from trainer.export.hf_format import DrafterFolderError

    state = load_file(str(exported / "model.safetensors"))
    extra = {**state, "layers.0.self_attn.extra.weight": torch.zeros(2)}
    fewer = {k: v for k, v in state.items() if k != "layers.1.mlp.up_proj.weight"}
    for name, tensors in (("extra", extra), ("fewer", fewer)):
        folder = tmp_path / name
        shutil.copytree(exported, folder)
        save_file(tensors, str(folder / "model.safetensors"))
        with pytest.raises(DrafterFolderError):
            load_folder(folder)
        with pytest.raises(RuntimeError, match="state_dict"):
            specforge_model(folder, torch.float32, torch.device("cpu"))
    assert json.loads((exported / "config.json").read_text())["architectures"] == [
        "DFlashDraftModel"
    ]
