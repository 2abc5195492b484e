"""Model FLOPs for the benchmarks' MFU: the trainer's own count (`trainer/model/flops.py`, where the
trainer also weighs the two roles' work for the default split), one implementation for both."""

from __future__ import annotations

from trainer.model.flops import (
    CHUNK,
    attention_pairs,
    delta_rule_flops_per_token,
    drafter_step_flops,
    target_forward_flops,
)

__all__ = [
    "CHUNK",
    "attention_pairs",
    "delta_rule_flops_per_token",
    "drafter_step_flops",
    "target_forward_flops",
]
