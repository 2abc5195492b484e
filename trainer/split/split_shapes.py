"""The default split of a node from the model shapes, before anything is measured: each role's
model FLOPs per context token (`trainer.model.flops`) stand in for the inverse of its rate, and
`trainer.split.split_rule.target_gpus_for_work` picks the split they predict fastest.

Why FLOPs: one rank's rate is the FLOPs per second its GPU sustains over the FLOPs per token of
its role. The sustained share of the peak differs between the roles far less than their FLOPs
per token do (the target forward and the drafter step on H200s: bench/results/seed-size/,
bench/results/split/), so the ratio of FLOPs places the split where the measured rates place it,
or next to it near a boundary (tests/trainer/test_split_shapes.py checks both records);
`trainer.commands.plan` measures the rates.

The work is counted for one sequence at the configured shape: `data.max_len` tokens, padded to
`data.bucket` for the target as a batch is, every token supervised, `data.num_anchors` blocks
of `model.block_size` drawn as `trainer.data.dataset.collate` draws them (seeded by `run.seed`):
- target: its decoder stack's forward (`target_forward_flops`), counted on the model built from
  its config on the meta device (its own layers and weights, no memory, nothing loaded);
- drafter: one training step (`drafter_step_flops`) of the drafter shaped as `[model]` says
  (`trainer.model.drafter.shape_from_target`), the KL term when `loss.kl_weight` > 0.
Both grow with the sequence length (the target's attention, the drafter's context attention),
which is why the length is the configured one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from trainer.settings.config import TrainConfig
from trainer.split.split_rule import target_gpus_for_work


@dataclass(frozen=True, kw_only=True)
class RoleWork:
    """Model FLOPs per context token of each role at the configured shape."""

    target_flops: float
    drafter_flops: float
    tokens: int  # per sequence: data.max_len

    def target_gpus(self, gpus: int) -> int:
        """The default number of target ranks of `gpus`."""
        return target_gpus_for_work(gpus, self.target_flops, self.drafter_flops)

    def figures(self) -> str:
        """`model FLOPs per token at N tokens a sequence: target …, drafter …`."""
        return (
            f"model FLOPs per token at {self.tokens:,} tokens a sequence: target "
            f"{flop_text(self.target_flops)}, drafter {flop_text(self.drafter_flops)}"
        )

    def describe(self, gpus: int) -> str:
        """`default split 6 + 2 of 8 GPUs (targets + drafters), from model FLOPs per token …`."""
        t = self.target_gpus(gpus)
        split = f"{t} + {gpus - t} of {gpus} GPUs (targets + drafters)"
        return f"default split {split}, from {self.figures()}"


def flop_text(flops: float) -> str:
    """Three significant digits and a unit: `58.8 GFLOP`, `13.0 GFLOP`, `156 kFLOP`."""
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if flops >= scale:
            value = flops / scale
            return f"{value:.{max(0, 2 - int(math.log10(value)))}f} {prefix}FLOP"
    return f"{flops:.0f} FLOP"


def target_config(config: TrainConfig) -> Any:
    """The target's `transformers` config: the demo's (built in memory, its assets may not exist
    yet), else `model.target`'s config.json."""
    if config.demo.enabled:
        from trainer.setup.demo import target_config as demo_target_config

        return demo_target_config(config.demo)
    from transformers import AutoConfig

    from trainer.model.target import check_target_folder

    check_target_folder(config.model.target)
    return AutoConfig.from_pretrained(config.model.target, local_files_only=True)


def role_work(config: TrainConfig, target: Any | None = None) -> RoleWork:
    """Each role's work per token for `config` (module docstring); `target`: the target's
    `transformers` config (default: `target_config(config)`)."""
    from trainer.data.dataset import bucket_length
    from trainer.model.fidelity import decoder_config

    target = target if target is not None else target_config(config)
    tokens = config.data.max_len
    padded = bucket_length(tokens, config.data.bucket)
    return RoleWork(
        target_flops=target_forward_work(decoder_config(target), padded) / tokens,
        drafter_flops=drafter_step_work(config, target) / tokens,
        tokens=tokens,
    )


def target_forward_work(decoder: Any, tokens: int) -> float:
    """Model FLOPs of the target's forward over one sequence of `tokens`, from its decoder
    config: the model built on the meta device, counted by `target_forward_flops`."""
    from transformers import AutoModelForCausalLM

    from trainer.model.flops import target_forward_flops

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(decoder)
    return target_forward_flops(model, tokens)["total"]


def drafter_step_work(config: TrainConfig, target: Any) -> float:
    """Model FLOPs of one drafter step on one sequence of `data.max_len` supervised tokens."""
    from trainer.data.dataset import Sample, collate
    from trainer.model.drafter import shape_from_target
    from trainer.model.fidelity import decoder_config
    from trainer.model.flops import drafter_step_flops
    from trainer.model.target import default_target_layers

    m, d = config.model, config.data
    layers = m.target_layers or default_target_layers(
        int(decoder_config(target).num_hidden_layers), m.num_target_layers
    )
    shape = shape_from_target(target, m, num_features=len(layers))
    batch = collate(
        [Sample([d.pad_token_id] * d.max_len, [True] * d.max_len)],
        block_size=m.block_size,
        num_anchors=d.num_anchors,
        bucket=d.bucket,
        pad_token_id=d.pad_token_id,
        generators=[torch.Generator().manual_seed(config.run.seed)],
    )
    return drafter_step_flops(shape, batch, kl=config.loss.kl_weight > 0)
