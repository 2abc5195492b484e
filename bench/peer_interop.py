"""Does a drafter folder mean the same to SpecForge's `DFlashDraftModel` as to ours?

`check(folder, target, …)` loads the folder twice: into ours (`trainer.export.hf_format.load_folder`)
and into SpecForge's class (built from the folder's `config.json`, the tensors loaded with
`strict=True`), compares the tensor names key for key, then the block logits of both on the
same context and anchors: ours' `Drafter.forward`; SpecForge's model forward with the block
tokens, positions and dense masks its own training wrapper builds (`OnlineDFlashModel`'s
`_create_noise_embed` and `_create_position_ids`, `create_dflash_sdpa_mask`, one per layer kind
where the drafter has sliding-window layers), on SDPA. Both heads are the target's lm_head. Either folder direction works: ours' export, or a folder
SpecForge's exporter wrote."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def specforge_model(folder: Path, weights: torch.dtype, device: torch.device) -> Any:
    """SpecForge's `DFlashDraftModel` of the folder's config, its tensors loaded strictly."""
    from safetensors.torch import load_file
    from specforge.modeling.draft.dflash import DFlashDraftModel
    from specforge.training.model_loading import load_draft_config_source

    config = load_draft_config_source(str(folder / "config.json"))
    config._attn_implementation = "sdpa"  # the dense bool mask below
    model = DFlashDraftModel(config).to(weights)
    model.load_state_dict(load_file(str(folder / "model.safetensors")), strict=True)
    return model.to(device).eval()


def check(
    folder: Path,
    target: Any,
    input_ids: torch.Tensor,
    anchors: torch.Tensor,
    *,
    weights: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """Key sets and block logits of `folder` in both classes; input_ids (1, S), anchors (1, N)."""
    from safetensors.torch import load_file
    from specforge.algorithms.common.dflash_family_model import (
        OnlineDFlashModel,
        create_dflash_sdpa_mask,
    )

    from trainer.export.hf_format import load_folder

    device = target.device
    saved = set(load_file(str(folder / "model.safetensors")))
    theirs = specforge_model(folder, weights, device)
    ours, cfg = load_folder(folder, device=device, dtype=weights)
    ours.attention_backend = "sdpa"  # as the evaluator drafts (`DFlashDrafter`)
    persistent = set(theirs.state_dict())
    embed = target.embed_weight.detach().to(weights)
    head = target.lm_head_weight.detach().to(weights)
    valid = torch.ones_like(anchors, dtype=torch.bool)
    with torch.no_grad():
        features = target(input_ids).features.to(weights)  # (1, S, n·H)
        mine = ours(features, input_ids, anchors, valid, embed)  # (1, N, B, H)
        wrap = OnlineDFlashModel(
            draft_model=theirs, target_lm_head=_linear(head), target_embed_tokens=_embedding(embed),
            mask_token_id=int(cfg["dflash_config"]["mask_token_id"]),
            block_size=int(cfg["block_size"]), attention_backend="sdpa",
            num_anchors=anchors.shape[1],
        )  # fmt: skip
        seq = input_ids.shape[1]
        positions = torch.cat(
            [torch.arange(seq, device=device)[None], wrap._create_position_ids(anchors)], dim=1
        )
        mask: Any = create_dflash_sdpa_mask(anchors, valid, seq, wrap.block_size, device)
        if theirs.sliding_window is not None:  # per layer kind, as its wrapper passes them
            window = create_dflash_sdpa_mask(
                anchors, valid, seq, wrap.block_size, device, sliding_window=theirs.sliding_window
            )
            mask = {"full_attention": mask, "sliding_attention": window}
        hers = theirs(
            position_ids=positions,
            attention_mask=mask,
            noise_embedding=wrap._create_noise_embed(input_ids, anchors, valid),
            target_hidden=features,
        )  # (1, N·B, H)
    want = mine.reshape(hers.shape).double() @ head.double().T
    got = hers.double() @ head.double().T
    return {
        "folder": str(folder),
        "tensors": len(saved),
        "missing_in_folder": sorted(persistent - saved),
        "unknown_to_specforge": sorted(saved - persistent),
        "block_logits_max_rel_diff": float((got - want).abs().max() / want.abs().max()),
        "dtype": str(weights).removeprefix("torch."),
    }


def _linear(weight: torch.Tensor) -> nn.Linear:
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    head.weight = nn.Parameter(weight, requires_grad=False)
    return head


def _embedding(weight: torch.Tensor) -> nn.Embedding:
    return nn.Embedding.from_pretrained(weight, freeze=True)


def on_training_data(folders: dict[str, Path], settings: Any) -> dict[str, Any]:
    """`check` for each folder on the first training sample (its first supervised positions as
    anchors), with the comparison's target on its device."""
    from bench.peer_recipe import target_layers, usable_samples
    from trainer.data.dataset import anchor_candidates
    from trainer.model.target import load_target

    device = torch.device(settings.device)
    target = load_target(settings.root / "target", device=device, layers=target_layers(settings))
    target.model.float()
    sample = usable_samples(settings)[0]
    ids = torch.tensor([sample.input_ids], device=device)
    starts = anchor_candidates(sample.loss_mask)[:: settings.block_size][:8]
    anchors = starts[None].to(device)
    return {name: check(path, target, ids, anchors) for name, path in folders.items()}
