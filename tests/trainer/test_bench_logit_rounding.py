"""`bench/logit_rounding.py`: the rounding the lossless check's tie tolerances rest on. On this
CPU, float32 moves logits between forward lengths far less than its tolerance, bf16 less than its
own; a tolerance below the rounding would report ties as violations."""

from __future__ import annotations

import torch

from bench.logit_rounding import largest_change, random_target
from trainer.evaluation.lossless import HALF_RTOL, TIE_RTOL


def test_the_tie_tolerances_lie_above_the_rounding() -> None:
    fp32 = largest_change(random_target(2, torch.float32, "cpu"), trials=1, length=48)
    bf16 = largest_change(random_target(2, torch.bfloat16, "cpu"), trials=1, length=48)
    assert fp32 < TIE_RTOL[torch.float32] / 10
    assert fp32 < bf16 < HALF_RTOL
