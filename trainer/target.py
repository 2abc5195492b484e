"""The frozen target: loaded with `transformers` from a local folder, returns the features the
drafter is conditioned on.

Layer convention: "target layer i" is the output of the decoder layer with 0-based index i, which
is `hidden_states[i + 1]` of a `transformers` forward with `output_hidden_states=True`
(`hidden_states[0]` is the embedding output). The last entry of `hidden_states` is the *normed*
output in current `transformers` versions, so layers are limited to 0 … L−2; the normed last
hidden state (what the lm_head reads) is taken from `last_hidden_state`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from trainer.config import TrainConfigError


def default_target_layers(num_layers: int, count: int = 5) -> list[int]:
    """`count` layers spread evenly from layer 1 to L−3 (for L = 64: [1, 16, 31, 46, 61])."""
    first, last = 1, num_layers - 3
    if last < first:
        return [max(0, num_layers - 2)]
    if count == 1:
        return [last]
    return sorted({round(first + i * (last - first) / (count - 1)) for i in range(count)})


@dataclass
class TargetOutput:
    features: torch.Tensor  # (Bsz, S, n·H): selected layers' hidden states, concatenated
    last_hidden: torch.Tensor  # (Bsz, S, H): final normed hidden state


class Target:
    """A frozen causal LM. `embed_weight` and `lm_head_weight` are shared (frozen) with the
    drafter and the loss."""

    def __init__(self, model: nn.Module, layers: list[int]) -> None:
        self.model = model
        self.config = model.config
        num_layers = self.config.num_hidden_layers
        bad = [i for i in layers if not 0 <= i <= num_layers - 2]
        if bad:
            raise TrainConfigError(
                "model.target_layers",
                f"{bad} outside 0…{num_layers - 2} for a {num_layers}-layer target",
            )
        self.layers = list(layers)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def embed_weight(self) -> torch.Tensor:
        return self.model.get_input_embeddings().weight  # (V, H)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight  # (V, H)

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> TargetOutput:
        """input_ids (Bsz, S), right-padded: causal attention keeps real positions clean."""
        base = getattr(self.model, self.model.base_model_prefix)
        out = base(input_ids=input_ids, output_hidden_states=True, use_cache=False)
        hs = out.hidden_states
        features = torch.cat([hs[i + 1] for i in self.layers], dim=-1)  # (Bsz, S, n·H)
        return TargetOutput(features=features, last_hidden=out.last_hidden_state)


def load_target(
    folder: str | Path,
    *,
    device: torch.device | str = "cpu",
    layers: list[int] | None = None,
    num_layers: int = 5,
) -> Target:
    """Load a `save_pretrained` folder (no hub access): bf16 on CUDA, fp32 on the CPU, eval mode,
    no gradients."""
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise TrainConfigError(
            "model.target", f"{folder} has no config.json (a save_pretrained folder)"
        )
    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
    model.to(device).eval()
    model.requires_grad_(False)
    if layers is None:
        layers = default_target_layers(model.config.num_hidden_layers, num_layers)
    return Target(model, layers)
