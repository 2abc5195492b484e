"""The frozen target: loaded with `transformers` from a local folder, returns the features the
drafter is conditioned on.

Layer convention: "target layer i" is the output of the decoder layer with 0-based index i, which
is `hidden_states[i + 1]` of a `transformers` forward with `output_hidden_states=True`
(`hidden_states[0]` is the embedding output). The last entry of `hidden_states` is the *normed*
output in current `transformers` versions, so layers are limited to 0 … L−2; the normed last
hidden state (what the lm_head reads) is taken from `last_hidden_state`.

The selected layers' outputs are kept by forward hooks on those layers, not asked for with
`output_hidden_states=True`: that keeps every layer's output alive until the forward ends (L + 1
tensors of S × H; at a long sequence, tens of GiB more than the n layers the drafter reads).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer.settings.config import TrainConfigError

if TYPE_CHECKING:  # transformers loads only with the target
    from transformers import PreTrainedModel


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

    def __init__(self, model: PreTrainedModel, layers: list[int]) -> None:
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
        self._kept: dict[int, torch.Tensor] = {}  # the selected layers' outputs of one forward
        self._keeping = False  # only inside `forward`: another call of the model keeps nothing
        decoder = getattr(model, model.base_model_prefix).layers
        for i in self.layers:
            decoder[i].register_forward_hook(self._keeper(i))

    def _keeper(self, i: int) -> Any:
        """The hook that keeps layer `i`'s output (a decoder layer returns its hidden state, or
        a tuple that starts with it)."""

        def keep(module: nn.Module, args: Any, output: Any) -> None:
            if self._keeping:
                self._kept[i] = output[0] if isinstance(output, tuple) else output

        return keep

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def embed_weight(self) -> torch.Tensor:
        return _weight(self.model.get_input_embeddings())  # (V, H)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return _weight(self.model.get_output_embeddings())  # (V, H)

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def weights_read(self) -> int:
        """Parameters one forward reads: all but the input embedding table, of which it reads a
        row per token, unless that table is also the lm_head (`trainer.evaluation.draft_cost`)."""
        total = sum(p.numel() for p in self.model.parameters())  # a tied table counts once
        if self.embed_weight is not self.lm_head_weight:  # tied: one parameter, as counted
            total -= self.embed_weight.numel()
        return total

    def logits(self, last_hidden: torch.Tensor) -> torch.Tensor:
        """(…, H) final hidden states → (…, V) fp32 logits through the frozen lm_head."""
        return last_hidden.float() @ self.lm_head_weight.float().T

    def starting_weights(self, layers: list[int]) -> dict[str, torch.Tensor]:
        """The weights that start a drafter from this target (`model.init_layers`): decoder
        layer `layers[i]` under the drafter's names `layers.i.…`, and the final norm as `norm.…`.
        The drafter's layers are Qwen3-style like the target's, so the names below a layer are
        the same."""
        base = getattr(self.model, self.model.base_model_prefix)
        count = len(base.layers)
        bad = [j for j in layers if not 0 <= j < count]
        if bad:
            raise TrainConfigError(
                "model.init_layers", f"{bad} outside 0…{count - 1} for a {count}-layer target"
            )
        weights = {
            f"layers.{i}.{name}": tensor
            for i, j in enumerate(layers)
            for name, tensor in base.layers[j].state_dict().items()
        }
        weights.update({f"norm.{name}": t for name, t in base.norm.state_dict().items()})
        return weights

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> TargetOutput:
        """input_ids (Bsz, S), right-padded: causal attention keeps real positions clean."""
        return self.forward(input_ids)

    def forward(self, input_ids: torch.Tensor) -> TargetOutput:
        """`__call__` outside `no_grad`: the function `torch.compile` traces (`TargetWorker`)."""
        base = getattr(self.model, self.model.base_model_prefix)
        self._keeping = True
        out = base(input_ids=input_ids, use_cache=False)
        self._keeping = False
        features = torch.cat([self._kept[i] for i in self.layers], dim=-1)  # (Bsz, S, n·H)
        self._kept.clear()
        return TargetOutput(features=features, last_hidden=out.last_hidden_state)


def load_target(
    folder: str | Path | Any,
    *,
    device: torch.device | str = "cpu",
    layers: list[int] | None = None,
    num_layers: int = 5,
    seed: int = 0,
) -> Target:
    """Load a `save_pretrained` folder (no hub access): bf16 on CUDA, fp32 on the CPU, eval mode,
    no gradients. `folder` may also be an in-memory `transformers` config: the model is then
    built directly on `device` with random weights (seeded; for tests and benchmarks at real
    shapes, nothing written to disk)."""
    from transformers import AutoModelForCausalLM

    device = torch.device(device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model: PreTrainedModel
    if hasattr(folder, "to_dict") and not isinstance(folder, str | Path):
        model = _random_model(folder, device=device, dtype=dtype, seed=seed)
    else:
        folder = check_target_folder(folder)
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), dtype=dtype, local_files_only=True
        )
    # transformers wraps `to` in a decorator whose typing loses the bound `self`
    model.to(device).eval()  # type: ignore[arg-type]
    model.requires_grad_(False)
    if layers is None:
        layers = default_target_layers(model.config.num_hidden_layers, num_layers)
    return Target(model, layers)


def check_target_folder(folder: str | Path) -> Path:
    """`folder` as a path, refused (`model.target`) unless it holds a config.json."""
    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise TrainConfigError(
            "model.target", f"{folder} has no config.json (a save_pretrained folder)"
        )
    return folder


def _weight(layer: nn.Module | None) -> torch.Tensor:
    """The weight of an embedding or output head (a parameter; `nn.Module`'s typing cannot say)."""
    weight = getattr(layer, "weight", None)
    assert isinstance(weight, torch.Tensor)
    return weight


def _random_model(
    config: Any, *, device: torch.device, dtype: torch.dtype, seed: int
) -> PreTrainedModel:
    """Random weights built on `device` in `dtype` (no fp32 copy on the CPU first)."""
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.manual_seed(seed)
    try:
        torch.set_default_dtype(dtype)
        with device:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.to(device=device, dtype=dtype)
    finally:
        torch.set_default_dtype(previous)
